"""Exports of attnslim outputs into formats that other engines load without attnslim.

deepseek.py: an all-MLA output as a stock DeepseekV3ForCausalLM checkpoint (transformers, vLLM).
"""

from attnslim.export.deepseek import ExportOptions, export_deepseek

__all__ = ["ExportOptions", "export_deepseek"]
