"""Serving attnslim outputs with vLLM (its CPU build lives in .venv-vllm, built by `make serve-setup`).

Modules that run inside vLLM's environment (plugin, vllm_model, offline) import only the standard library, torch,
vllm, transformers' public config classes and `attnslim.errors`: that environment has transformers < 5.20.
"""
