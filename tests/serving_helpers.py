"""What the serving tests share (tests/test_serving.py, tests/test_serving_deci.py): the 8 wiki prompts, the offline
vLLM driver run in .venv-vllm, and the prompt perplexity of its log-probs."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from attnslim.serving.launch import serving_python

PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 96, 64
KV_GIB = "1"


def wiki_prompts() -> list[list[int]]:
    from attnslim.data import eval_windows
    from attnslim.models import load_model

    _, tokenizer = load_model("smollm2-135m")
    windows = eval_windows("wiki", tokenizer, tokens=PROMPTS * PROMPT_LEN, seq_len=PROMPT_LEN)
    return [[int(t) for t in row] for row in windows.ids]


def offline(work: Path, models: list[str], prompts: list[list[int]], **extra: object) -> dict[str, dict]:
    """attnslim.serving.offline on `models` in one vLLM process (float32, KV_GIB of KV cache); `extra` goes into
    its request."""
    request = {"models": models, "dtype": "float32", "max_model_len": 1024,
               "correctness": {"prompts": prompts, "max_tokens": MAX_TOKENS}, **extra}
    (work / "request.json").write_text(json.dumps(request))
    proc = subprocess.run(
        [str(serving_python()), "-m", "attnslim.serving.offline", str(work / "request.json"), str(work / "out.json")],
        cwd=work, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KV_GIB), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return dict(json.loads((work / "out.json").read_text()))


def perplexity(logprobs: list[list[float]]) -> float:
    flat = [x for row in logprobs for x in row]
    return math.exp(-sum(flat) / len(flat))
