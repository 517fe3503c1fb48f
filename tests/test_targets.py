"""The default recipe's targets (attnslim.targets) and the demo's met/missed lines with measured reasons."""

from __future__ import annotations

import warnings

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.demo import TASKS, target_lines
from attnslim.targets import TARGETS, check_targets, targets_met
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step


def test_check_targets_boundaries_and_worst_task():
    at_goal = check_targets(kv=0.5, total=0.85, wiki=1.25, acc_drop={"a": 3.0, "b": -1.0}, decode=1.0)
    assert targets_met(at_goal) == {key: True for key in ("kv", "total", "wiki", "acc", "decode")}
    assert list(targets_met(at_goal)) == ["kv", "total", "wiki", "acc", "decode"]
    missed = check_targets(kv=0.51, total=0.9, wiki=1.3, acc_drop={"a": 0.0, "b": 3.5}, decode=0.99)
    assert not any(targets_met(missed).values())
    acc = next(c for c in missed if c.key == "acc")
    assert "b -3.5" in acc.measured and "a +0.0" in acc.measured and f"{TARGETS['acc_points']:g} points" in acc.goal


def test_demo_target_lines_give_reasons_for_structural_misses():
    dense, model = tiny_llama(), tiny_llama()
    model.load_state_dict(dense.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, ByteTokenizer(), one_step("latentllm", {"ratio": 1.0, "kv_ratio": 0.5}), progress=False)

    def side(m, ppl, acc):
        return {"ppl": {"wiki": ppl}, "acc": dict.fromkeys(TASKS, acc), "kv": 100.0,
                "params": get_adapter(m).param_groups()}

    before, after = side(dense, 10.0, 0.60), side(model, 11.0, 0.55)
    after["kv"] = 50.0
    lines = target_lines(before, after, {"dense": 20.0, "compressed": 15.0, "ratio_low": 0.7, "ratio_high": 0.8},
                         dense, model)
    text = "\n".join(lines)
    assert "[met] KV bytes/token" in text and "0.500×" in text and "[met] wiki perplexity" in text
    assert "[MISSED] zero-shot accuracy" in text and "piqa -5.0 points" in text
    assert "[MISSED] total parameters" in text and "why: dense parameters are embedding" in text
    assert "[MISSED] decode tokens/s" in text and "0.75× (repetitions 0.70–0.80×)" in text
    assert "why: FLOPs per new token at 512" in text
