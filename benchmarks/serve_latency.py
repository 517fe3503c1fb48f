"""Latency through vLLM's OpenAI-compatible server, started by `attnslim serve` (used by serve.py).

Per variant: one server, one untimed warm-up request, then `requests` streamed completions one after another
(a single client: latency, not load), each a random-token prompt of `prompt_len` tokens and `new_tokens` greedy
tokens (ignore_eos). Time to first token (TTFT) is from sending the request to the first streamed token; the
inter-token latency (ITL, vLLM's "TPOT") is (last token's arrival − first's) / (new_tokens − 1) per request: the
server may flush several tokens in one chunk, so gaps between chunks are not per-token times. Medians over the
requests.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnslim.serving.probe import free_port, wait_ready

SPEC = {"requests": 8, "prompt_len": 256, "new_tokens": 64}


def _one(client: Any, model: str, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, mean time per later token) of one streamed completion, in ms."""
    start = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=model, prompt=ids, max_tokens=new_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            stamps.append(time.perf_counter())
    return (stamps[0] - start) * 1e3, (stamps[-1] - stamps[0]) * 1e3 / max(new_tokens - 1, 1)


def latency(directory: str, dtype: str, kv_gib: str, log: Path) -> dict[str, Any]:
    import json

    import openai

    vocab = int(json.loads((Path(directory) / "config.json").read_text())["vocab_size"])
    port = free_port()
    argv = [sys.executable, "-m", "attnslim", "serve", directory, "--port", str(port), "--dtype", dtype,
            "--max-model-len", "1024", "--kv-cache-gib", kv_gib]
    with log.open("w") as sink:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # a keyless loopback server
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, vocab, (SPEC["requests"] + 1, SPEC["prompt_len"]), generator=gen).tolist()
        _one(client, directory, prompts[0], 4)  # warm-up
        ttft, itl = [], []
        for ids in prompts[1:]:
            first, per_token = _one(client, directory, ids, SPEC["new_tokens"])
            ttft.append(first)
            itl.append(per_token)
        return {"ttft_ms": ttft, "itl_ms": itl, "median_ttft_ms": statistics.median(ttft),
                "median_itl_ms": statistics.median(itl)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
