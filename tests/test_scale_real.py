"""benchmarks/scale_real.py (issue 44 item 3): its rows are the packaged recipes at the issue's budgets, each a valid
recipe; a results file scored on another item subset is refused; the report's verdicts read the rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import report_scale_real  # noqa: E402
import scale_real  # noqa: E402

from attnslim.recipe import load_recipe, recipe_from_dict  # noqa: E402


def test_rows_are_the_issues_variants_on_one_calibration() -> None:
    rows = scale_real.rows(windows=8)
    for kv in (0.625, 0.5, 0.25):  # mla beside transmla at every KV point
        assert rows[f"mla-kv{kv}"]["steps"][0]["args"]["kv_ratio"] == kv
        assert rows[f"transmla-kv{kv}"]["steps"][0] == {"method": "transmla", "layers": "all",
                                                          "args": {"kv_ratio": kv}}
    assert rows["nbl-12"]["steps"][0]["args"]["m"] == 12 and rows["drop-12"]["steps"][0]["args"]["count"] == 12
    assert rows["mla-kv0.5-heal40"]["heal"] == load_recipe("default").heal  # the standard heal, not a copy
    # latentllm beside its baseline at the same kept attention size
    assert rows["svdllm-attn-80"]["steps"][0]["args"]["ratio"] == rows["latentllm-attn-80"]["steps"][0]["args"]["ratio"]
    assert {r["calibration"]["windows"] for r in rows.values()} == {8}
    for key, row in rows.items():
        recipe = recipe_from_dict(row)
        common.resolved_fingerprint(recipe)  # every method accepts its arguments
        packaged = {"mla": "mla", "nbl": "nbl", "drop": "drop", "latentllm": "latentllm",
                    "svdllm": "svdllm"}.get(recipe.steps[0].method)
        if packaged:  # the packaged recipe's arguments, but the budget
            args = dict(load_recipe(packaged).steps[0].args)
            for budget in ("kv_ratio", "m", "count"):
                args.pop(budget, None)
            assert args.items() <= dict(recipe.steps[0].args).items(), key


def test_a_file_scored_on_another_subset_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    tasks = ["arc_easy", "piqa"]
    h = scale_real.ScaleHarness("scale-test", "smollm2-135m", 512, 20, tasks)
    h.save()
    scale_real.ScaleHarness("scale-test", "smollm2-135m", 512, 20, tasks)  # the same subset: accepted
    with pytest.raises(SystemExit, match="standard_limit"):
        scale_real.ScaleHarness("scale-test", "smollm2-135m", 512, 50, tasks)


def _row(ppl: float, items: list[int], kv: int = 100) -> dict[str, object]:
    sources = ("wiki", "ptb", "c4")
    avg = {"acc": sum(items) / len(items), "acc_stderr": 0.1}
    return {"ppl": dict.fromkeys(sources, ppl), "ppl_ratio": dict.fromkeys(sources, ppl / 10),
            "kv_bytes_per_token": kv, "compress_seconds": 1.0, "peak_rss_mb": 5000,
            "standard": {"average": avg, "items": {"arc_easy": items}}}


def test_section_states_the_verdicts_the_rows_support() -> None:
    env = {"device": "cpu", "threads": 2, "torch": "t", "transformers": "x",
           "command": "benchmarks/scale_real.py --limit=4 --row=mla-kv0.625"}
    data = {"model": "qwen2.5-1.5b", "environment": env, "suite": {"standard_tasks": ["arc_easy"],
                                                                    "standard_limit": 4},
            "eval": {"sources": ["wiki", "ptb", "c4"], "tokens": 2048},
            "dense": _row(10.0, [1, 1, 0, 1], kv=160),
            "variants": {"mla-kv0.625": _row(10.5, [1, 1, 0, 1]), "transmla-kv0.625": _row(12.0, [1, 0, 0, 0]),
                         "latentllm-attn-80": _row(11.0, [1, 1, 0, 1]), "svdllm-attn-80": _row(10.8, [1, 1, 0, 0]),
                         "mla-kv0.5": _row(11.0, [1, 0, 0, 1]), "mla-kv0.5-heal40": _row(10.4, [1, 1, 0, 1])}}
    text = "\n".join(report_scale_real.scale_real_section(data))
    assert "latentllm-attn-80 beats svdllm-attn-80 on 0 of 3 sources; average accuracy +25.0" in text
    assert "mla-kv0.625 beats transmla-kv0.625 on 3 of 3 sources (wiki, ptb, c4); average accuracy +50.0" in text
    assert "wiki 1.050× (target ≤ 1.10×: met); average accuracy +0.0 ± 0.0 points against dense" in text
    assert ("mla-kv0.5-heal40 against mla-kv0.5 (the heal alone): wiki 1.100× → 1.040×, ptb 1.100× → 1.040×, "
            "c4 1.100× → 1.040×; average accuracy +25.0") in text
    assert "mla-kv0.5-heal40 beats" not in text  # a healed row has no rival of its own
    assert "| mla-kv0.625 | 10.500 (1.050×)" in text and "| 0.625 |" in text
    assert "`OMP_NUM_THREADS=2 .venv/bin/python benchmarks/scale_real.py --limit=4`" in text  # the parent's call


def test_gpu_section_sets_its_rows_against_the_cpu_run_and_the_published_scores() -> None:
    env = {"device": "cuda", "gpu": "NVIDIA H200", "threads": 16, "torch": "t", "transformers": "x",
           "command": "benchmarks/scale_real.py --limit 4 --row=mla-kv0.625"}
    dense = _row(10.0, [1, 1, 0, 1], kv=160)
    dense["standard"]["tasks"] = {"winogrande": {"acc": 0.57}, "hellaswag": {"acc": 0.455, "acc_norm": 0.56}}
    dense["standard"]["eval_seconds"] = 30.0
    gpu_row = {**_row(10.5, [1, 1, 0, 1]), "ppl_ratio": dict.fromkeys(("wiki", "ptb", "c4"), 1.05)}
    gpu_row["standard"]["eval_seconds"] = 31.0
    cpu = {"mla-kv0.625": {"ppl_ratio": dict.fromkeys(("wiki", "ptb", "c4"), 1.05 * (1 + 2e-5))},
           "nbl-6": {"ppl_ratio": dict.fromkeys(("wiki", "ptb", "c4"), 1.2)}}
    data = {"model": "qwen2.5-1.5b", "environment": env, "suite": {"standard_tasks": ["arc_easy"],
                                                                    "standard_limit": 4},
            "eval": {"sources": ["wiki", "ptb", "c4"], "tokens": 2048}, "dense": dense,
            "variants": {"mla-kv0.625": gpu_row}}
    text = "\n".join(report_scale_real.scale_real_section(data, report_scale_real.GPU_STEM, cpu))
    assert text.startswith(f"## {report_scale_real.GPU_TITLE}") and "Device NVIDIA H200" in text
    assert "30.0–31.0 s per row for the suite" in text
    assert "differ from these by at most 2.0e-05 (relative), over all 1 rows" in text
    assert "Rows of the CPU run not measured in this one: nbl-6." in text
    assert "winogrande: published 60.7 (acc), ours acc 57.0" in text
    assert "hellaswag: published 61.8 (metric not stated), ours acc 45.5 / acc_norm 56.0" in text
