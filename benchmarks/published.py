"""Published dense scores of the packaged models on the standard tasks, beside which our dense scores are shown
(issue 44 item 5: a large gap would be a bug in the scoring). Data only; benchmarks/standard_tasks.py's docstring
says where each number comes from and why it is not the model card."""

from __future__ import annotations

from typing import Any

# percent
PUBLISHED: dict[str, dict[str, Any]] = {"smollm2-135m": {
    "source": "third-party lm-eval 0-shot, SmolLM2-135M-Instruct, 'Baseline' column of "
              "https://hface.pages.dev/lldois/SmolLM2-135M-Reasoning-SLERP-Champion (the model card publishes none)",
    "arc_easy": {"acc": 54.12}, "arc_challenge": {"acc_norm": 27.73}, "hellaswag": {"acc_norm": 42.99},
    "piqa": {"acc_norm": 66.92}},
    "qwen2.5-1.5b": {
        "source": "the Qwen2.5-Coder technical report (arXiv 2409.12186v3, Tables 13 and 14) for the BASE model "
                  "Qwen2.5-Coder-1.5B, few-shot in Qwen's own harness (shots as the Qwen2.5 report states for its "
                  "base models: MMLU 5, ARC-C 25, WinoGrande 5, HellaSwag 10; metric not stated); nothing is "
                  "published for the Instruct model we score, nor for the other tasks",
        "note": "not comparable number for number (base against instruct, few-shot against 0-shot, another harness): "
                "a 0-shot score a few points lower is expected (several on ARC-C's 25 shots); a gap beyond ~5 "
                "points on HellaSwag, WinoGrande or MMLU would point at the scoring",
        "mmlu": {"acc": 53.6}, "arc_challenge": {"acc?": 45.2}, "winogrande": {"acc": 60.7},
        "hellaswag": {"acc_norm?": 61.8}}}
