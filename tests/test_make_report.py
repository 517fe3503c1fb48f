"""benchmarks/make_report.py: a result's notes become paragraphs, and a table's rows stay one markdown table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_report.py"
sys.path.insert(0, str(REPORT.parent))  # report_claims & co. import by bare name, in any test order


def _report() -> ModuleType:
    sys.path.insert(0, str(REPORT.parent))
    spec = importlib.util.spec_from_file_location("benchmarks_make_report", REPORT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notes_are_paragraphs_and_table_rows_stay_contiguous() -> None:
    env = {"command": "benchmarks/mla.py --groups speed", "threads": 2, "device": "cpu", "torch": "t",
           "transformers": "x", "attnslim": "a"}
    notes = ["Decode against dense:", "", "| model | tok/s |", "|---|---|", "| dense | 1.0 |", "| mla | 1.1 |",
             "A closing remark."]
    lines = _report().section("mla-speed", {"environment": env, "notes": notes})
    start = lines.index("| model | tok/s |")
    assert lines[start : start + 4] == notes[2:6]  # no blank line inside the table: markdown renders one table
    assert lines[start - 1] == "" and lines[start - 2] == "Decode against dense:"
    assert lines[start + 4 : start + 6] == ["", "A closing remark."]  # prose after it is its own paragraph


def test_readme_summary_is_the_generated_table(tmp_path: Path) -> None:
    """README's Summary block is what make_report writes from the results: it cannot go stale silently."""
    report = _report()
    results = {p.stem: json.loads(p.read_text()) for p in sorted(report.RESULTS.glob("*.json"))
               if not p.stem.startswith("reliability") and "environment" in json.loads(p.read_text())}
    readme = REPORT.parents[1] / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(readme.read_text())
    report.write_summary(copy, report.summary(results, report.load_accuracy()))
    assert copy.read_text() == readme.read_text(), "README's summary is stale: run benchmarks/make_report.py"
    rows = [line for line in copy.read_text().splitlines() if line.startswith("| mla (+ 40-step heal) |")]
    assert len(rows) == 1


def test_write_summary_needs_its_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    with pytest.raises(SystemExit, match="no summary markers"):
        _report().write_summary(readme, ["| a |", "|---|", "| 1 |"])


def _run(limit: int, scored: dict[str, tuple[float, list[int]]]) -> dict[str, object]:
    """A summary_accuracy.json entry: one task, each model's per-item correctness."""
    models = {key: {"average": {"acc": acc, "acc_stderr": 0.05, "tasks": 1}, "items": {"piqa": items},
                    "tasks": {"piqa": {"acc": acc, "acc_stderr": 0.05}}, "threads": 1,
                    "command": "benchmarks/summary_accuracy.py"} for key, (acc, items) in scored.items()}
    return {"model": "smollm2-135m", "limit": limit, "tasks": ["piqa"], "models": models,
            "skipped": {"atp": "a cache policy"}}


def test_summary_accuracy_column_reads_one_run_and_says_why_a_row_has_none() -> None:
    report = _report()
    method, name, key, base, _ = report.HEADLINES[2]  # the default recipe's row
    results = {p.stem: json.loads(p.read_text()) for p in (report.RESULTS / f"{name}.json",)}
    small = _run(4, {"dense": (0.5, [1, 0, 1, 0]), key: (0.25, [1, 0, 0, 0]), base: (0.0, [0, 0, 0, 0])})
    big = _run(8, {"dense": (0.625, [1, 1, 1, 0, 1, 0, 1, 0]), key: (0.5, [1, 1, 0, 0, 1, 0, 1, 0])})
    lines = report.summary(results, {"a@4": small, "b@8": big})
    header = next(line for line in lines if line.startswith("| method |"))
    assert "dense 62.5 ± 5.0, n=8/task" in header  # the run with most items, not a mix of runs
    row = next(line for line in lines if line.startswith(f"| {method} |"))
    assert "| – |" in row  # its baseline is not in the 8-item run: no cell mixes runs
    note = lines[-2]
    assert method in note.split("not scored yet")[0].rsplit(";", 1)[-1] and "--limit 8" in note
    lines = report.summary(results, {"a@4": small})
    row = next(line for line in lines if line.startswith(f"| {method} |"))
    assert "| 25.0 ± 5.0 (base 0.0 ± 5.0) |" in row
    assert "dense 50.0 ± 5.0, n=4/task" in next(line for line in lines if line.startswith("| method |"))


def test_paired_difference_is_on_the_same_items() -> None:
    from report_accuracy import paired_difference

    a, b = {"t": [1, 1, 0, 1]}, {"t": [1, 0, 0, 1]}
    diff, se = paired_difference(a, b)
    assert diff == pytest.approx(0.25)
    assert se == pytest.approx((0.25 * 0.75 * 4 / 3 / 4) ** 0.5)  # sample variance of (0, 1, 0, 0) over n
    assert paired_difference(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError):  # items of another subset cannot be paired
        paired_difference(a, {"t": [1, 0, 0]})


def test_accuracy_section_lists_every_scored_model_and_the_rows_left() -> None:
    report = _report()
    _, _, key, base, _ = report.HEADLINES[2]
    run = _run(4, {"dense": (0.5, [1, 0, 1, 0]), key: (0.75, [1, 1, 1, 0]), base: (0.25, [1, 0, 0, 0])})
    text = "\n".join(report.accuracy_section({"r": run}, report.HEADLINES))
    row = f"| {key} | {report.HEADLINES[2][0]} variant | 75 ± 5 | **75.0 ± 5.0** | +25.0 ± 25.0 | +50.0 ± 28.9 |"
    assert row in text
    assert "atp (serving cache): not scored, a cache policy" in text
    # rows whose models the run lacks, named together
    assert "nbl, lisa, planner (mla, nbl, drop, keep per layer): not scored yet" in text


def test_plan_verdict_compares_with_the_best_single_method_of_the_same_budget_and_heal() -> None:
    _report()  # puts benchmarks/ on the path
    from report_plan import verdicts

    def row(wiki: float, ptb: float, c4: float) -> dict[str, object]:
        return {"ppl_ratio": {"wiki": wiki, "ptb": ptb, "c4": c4}}

    data = {"variants": {"plan-kv0.5": row(1.1, 1.4, 1.3), "mla-kv0.5": row(1.2, 1.3, 1.5),
                         "nbl-kv0.5": row(1.15, 2.0, 1.25), "plan-kv0.5-heal40": row(1.05, 1.2, 1.2),
                         "mla-kv0.5-heal40": row(1.0, 1.3, 1.3), "mla-kv0.25": row(0.5, 0.5, 0.5),
                         "plan-kv0.5-local": row(1.08, 1.3, 1.2), "mla-kv0.5-local": row(1.09, 1.2, 1.3),
                         "plan-kv0.5-local-planned": row(1.07, 1.25, 1.35),
                         "plan-kv0.5-norefit-heal40": row(1.02, 1.25, 1.15),
                         "mla-kv0.5-norefit-heal40": row(1.03, 1.1, 1.25)}}
    lines = verdicts(data)
    assert lines[2] == "| 0.5 | – | 1.100 / 1.400 / 1.300 | 1.150 (nbl) / 1.300 (mla) / 1.250 (nbl) | wiki |"
    # a healed plan meets every healed single-method row, converted with the refit or without (recipes/default.yaml)
    assert lines[3] == ("| 0.5 | standard | 1.050 / 1.200 / 1.200 | 1.000 (mla) / 1.100 (mla no refit) / "
                        "1.250 (mla no refit) | c4 |")
    assert lines[4] == ("| 0.5 | standard, mla converted without the output refit | 1.020 / 1.250 / 1.150 | "
                        "1.000 (mla) / 1.100 (mla no refit) / 1.250 (mla no refit) | c4 |")
    # a locally fitted plan meets only the locally fitted single-method rows, and they only it
    assert lines[5] == ("| 0.5 | local fit (one-shot) | 1.080 / 1.300 / 1.200 | 1.090 (mla) / 1.200 (mla) / "
                        "1.300 (mla) | wiki, c4 |")
    # a plan measured with the fit (plan --local-steps) meets the same locally fitted rows
    assert lines[6] == ("| 0.5 | local fit, planned with it (plan --local-steps) | 1.070 / 1.250 / 1.350 | 1.090 (mla) "
                        "/ 1.200 (mla) / 1.300 (mla) | wiki |")
    assert len(lines) == 7  # another budget's rows are never the rival
    # a plan calibrated on other text (plan.py --calib-source) meets the single-method rows calibrated either way,
    # and a plan calibrated on wiki meets them too; healed rows stay apart
    mixed = {"plan-kv0.5": row(1.1, 1.4, 1.3), "plan-kv0.5-calibwiki+c4": row(1.12, 1.3, 1.2),
             "mla-kv0.5": row(1.2, 1.35, 1.5), "mla-kv0.5-calibwiki+c4": row(1.25, 1.32, 1.25),
             "mla-kv0.5-heal40-calibwiki+c4": row(1.0, 1.0, 1.0)}
    lines = verdicts({"variants": mixed})
    assert lines[2] == ("| 0.5 | – | 1.100 / 1.400 / 1.300 | 1.200 (mla) / 1.320 (mla on wiki+c4) / "
                        "1.250 (mla on wiki+c4) | wiki |")
    assert lines[3] == ("| 0.5 | – (plan calibrated on wiki+c4) | 1.120 / 1.300 / 1.200 | 1.200 (mla) / "
                        "1.320 (mla on wiki+c4) / 1.250 (mla on wiki+c4) | wiki, ptb, c4 |")
    assert len(lines) == 4


def _claims(rule: list[object], **extra: object) -> list[object]:
    """One claim read from claims.yaml's structure: variant against baseline, wiki ratio, on SmolLM2 only."""
    _report()  # puts benchmarks/ on the path
    from report_claims import parse_claims

    cell = {"label": "80%", "file": "latentllm", "value": ["variants", "latentllm-80", "ppl_ratio", "wiki"],
            "baseline": ["variants", "svdllm-attn-80", "ppl_ratio", "wiki"], "holds_if": rule, **extra}
    return parse_claims([{"paper": "LatentLLM", "claim": "beats SVD-LLM", "paper_number": "Table 2",
                          "tried": "the spectrum ranks", "models": {"smollm2-135m": [cell],
                                                                    "gemma3-270m": "not run on Gemma-3"}}])


def _row(lines: list[str]) -> list[str]:
    row = next(line for line in lines if line.startswith("| LatentLLM |"))
    return [c.strip() for c in row.strip("|").split("|")]


def _results(value: float, base: float = 1.316) -> dict[str, object]:
    return {"latentllm": {"variants": {"latentllm-80": {"ppl_ratio": {"wiki": value}},
                                       "svdllm-attn-80": {"ppl_ratio": {"wiki": base}}}}}


def test_claims_section_computes_the_verdict_from_the_numbers_and_flips_at_the_rule() -> None:
    from report_claims import MODELS, claims_section

    claims = _claims(["<", 1])
    lines = claims_section(claims, _results(1.010))  # type: ignore[arg-type]
    header = next(line for line in lines if line.startswith("| paper |"))
    assert all(name in header for name in MODELS.values())
    row = _row(lines)
    assert row[3] == "80%: 1.010 vs 1.316 (ratio 0.767; holds if < 1) **holds**"
    assert row[4] == "not measured: not run on Gemma-3" and row[6] == "holds"
    assert row[7] == "–"  # what was tried shows only where the claim fails
    row = _row(claims_section(claims, _results(1.400)))  # type: ignore[arg-type]
    assert row[3].endswith("**fails**") and row[6] == "fails" and row[7] == "the spectrum ranks"
    row = _row(claims_section(claims, _results(1.316)))  # type: ignore[arg-type]
    assert row[6] == "fails"  # equal is not better: "<" is strict
    row = _row(claims_section(_claims(["<=", 1]), _results(1.316)))  # type: ignore[arg-type]
    assert row[6] == "holds"


def test_a_claim_whose_number_is_missing_renders_not_measured() -> None:
    from report_claims import claims_section

    claims = _claims(["<", 1])
    results = _results(1.010)
    del results["latentllm"]["variants"]["svdllm-attn-80"]  # type: ignore[index]
    row = _row(claims_section(claims, results))  # type: ignore[arg-type]
    assert row[3] == "80%: not measured: no `variants.svdllm-attn-80` in latentllm.json"
    assert row[6] == "not measured" and "1.010" not in row[3]  # no number beside a missing baseline
    row = _row(claims_section(claims, {}))  # type: ignore[arg-type]
    assert row[3] == "80%: not measured: no latentllm.json" and row[6] == "not measured"
    row = _row(claims_section(_claims(["<", 1], pending="not run yet"), {}))  # type: ignore[arg-type]
    assert row[3] == "80%: not measured: not run yet"
    # a baseline from another file counts only if both files evaluated the same windows (same dense perplexity)
    split = _results(1.0)
    split["baselines"] = {"dense": {"ppl": {"wiki": 9.16}}, "variants": split["latentllm"]["variants"]}  # type: ignore
    split["latentllm"]["dense"] = {"ppl": {"wiki": 9.16}}  # type: ignore[index]
    claims = _claims(["<", 1], baseline_file="baselines")
    assert _row(claims_section(claims, split))[6] == "holds"  # type: ignore[arg-type]
    split["baselines"]["dense"] = {"ppl": {"wiki": 9.2}}  # type: ignore[index]
    row = _row(claims_section(claims, split))  # type: ignore[arg-type]
    assert row[6] == "not measured" and "evaluate different windows" in row[3]


def test_a_claim_over_seeds_reads_the_median_of_each_side() -> None:
    from report_claims import claims_section

    claims = _claims(["<", 1], median_over=["", "-seed1", "-seed2"])
    results = _results(1.0)
    rows = results["latentllm"]["variants"]  # type: ignore[index]
    for suffix, (v, b) in {"": (1.25, 1.33), "-seed1": (1.28, 1.28), "-seed2": (1.29, 1.24)}.items():
        rows[f"latentllm-80{suffix}"] = {"ppl_ratio": {"wiki": v}}
        rows[f"svdllm-attn-80{suffix}"] = {"ppl_ratio": {"wiki": b}}
    row = _row(claims_section(claims, results))  # type: ignore[arg-type]
    assert row[3] == "80%: 1.280 vs 1.280 (medians of 3 runs; ratio 1; holds if < 1) **fails**"  # seed 0: holds
    del rows["svdllm-attn-80-seed2"]
    row = _row(claims_section(claims, results))  # type: ignore[arg-type]
    assert row[3] == "80%: not measured: no `variants.svdllm-attn-80-seed2` in latentllm.json"
    with pytest.raises(SystemExit, match="median_over"):
        _claims(["<", 1], median_over=["-seed1"], value=["ppl", "wiki"])


def test_accuracy_claims_are_paired_and_within_noise_when_the_rule_would_flip() -> None:
    from report_claims import measure, parse_claims

    def verdict(variant: list[int]) -> str:
        claim = parse_claims([{"paper": "p", "claim": "c", "paper_number": "n", "models": {"smollm2-135m": [
            {"file": "summary_accuracy", "accuracy": ["r", "v", "b"], "holds_if": [">", 0]}]}}])[0]
        base = [1, 0] * 20
        models = {k: {"items": {"piqa": items}, "average": {"acc": sum(items) / len(items)}}
                  for k, items in (("v", variant), ("b", base))}
        cell = claim.cells["smollm2-135m"]
        assert not isinstance(cell, str)
        return measure(cell[0], {"summary_accuracy": {"r": {"models": models}}})[1]

    assert verdict([1, 1] * 20) == "holds"  # +50 points on the same 40 items
    assert verdict([0, 0] * 20) == "fails"
    assert verdict([1, 0] * 19 + [1, 1]) == "within noise"  # one item better: inside two paired errors


def test_claims_rules_are_checked_on_load() -> None:
    with pytest.raises(SystemExit, match="holds_if"):
        _claims(["≈", 1])
    with pytest.raises(SystemExit, match="compare"):
        _claims(["<", 1], compare="value")  # a baseline was given: value would ignore it


def test_every_claim_of_claims_yaml_finds_its_number_in_the_results() -> None:
    """A typo in a results key would silently read "not measured": every measurement not marked `pending` must
    resolve on the repo's results; a claim that fails says what was tried; one row per claim."""
    report = _report()
    from report_claims import claims_section, load_claims, load_results, measure

    claims, results = load_claims(), load_results(report.RESULTS)
    for claim in claims:
        for cell in claim.cells.values():
            for m in () if isinstance(cell, str) else cell:
                verdict = measure(m, results)[1]
                assert m.pending or verdict != "not measured", (claim.claim, m.label, measure(m, results))
                assert verdict != "fails" or claim.tried, f"{claim.claim!r} fails: say what was tried"
    rows = [line for line in claims_section(claims, results) if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(claims) + 1  # the header


def test_demo_time_lines_say_met_or_missed_against_the_budget_per_run() -> None:
    from report_demo import demo_time_lines

    host = {"cpu": "AMD EPYC", "threads": 2}
    stages = {"measure dense": 50.0, "compress": 250.0}
    data = {"budget_s": 360, "runs": [
        {"when": "2026-11-29 01:00", "host": host, "load_before": 0.1, "heal_precision": "bfloat16",
         "stages": stages, "wall_s": 330.0},
        {"when": "2026-11-29 02:00", "host": host, "load_before": 3.9, "heal_precision": "float32",
         "stages": stages, "wall_s": 458.0}]}
    lines = demo_time_lines(data)
    rows = [line for line in lines if line.startswith("| 2026")]
    assert "| measure dense | compress |" in lines[2]
    assert rows[0].endswith("| 50 | 250 | 330 | met |") and "| bfloat16 |" in rows[0]
    assert rows[1].endswith("| 458 | missed |") and "| 3.9 |" in rows[1]
    assert demo_time_lines({"budget_s": 360, "runs": []}) == []


def test_serve_section_names_its_model_file_and_that_models_target() -> None:
    import report_serve

    def variant(tp: float, kv: int) -> dict[str, object]:
        return {"output_tokens_per_s": [tp, tp], "median_output_tokens_per_s": tp, "throughput_vs_dense": tp / 10,
                "kv_tokens": kv, "kv_vs_dense": kv / 1000}

    data = {"environment": {"command": "benchmarks/serve.py --model qwen2.5-1.5b", "cpu_count": 2,
                            "serving": {"vllm": "v", "torch": "t", "transformers": "x"}},
            "workload": {"prompts": 8, "input_len": 256, "output_len": 64}, "dtype": "bfloat16", "rounds": 2,
            "kv_cache_space_gib": 2.0, "calibration": {"source": "wiki", "windows": 16, "seq_len": 256},
            "model": "qwen2.5-1.5b", "variants": {"dense": variant(10.0, 1000), "nbl-12": variant(12.0, 1750)}}
    text = "\n".join(report_serve.serve_section(data))
    assert text.startswith("## Serving with vLLM (CPU build): throughput and KV capacity, qwen2.5-1.5b")
    assert "→ `benchmarks/results/serve-qwen2.5-1.5b.json`" in text
    assert "throughput ≥ 1.25× dense, measured 1.200× (missed); KV capacity ≥ 1.6×, measured 1.750× (met)" in text
    data["model"] = "smollm2-135m"  # the default model: its own file, its own (first issue's) target
    text = "\n".join(report_serve.serve_section(data))
    assert "`benchmarks/results/serve.json`" in text and "throughput ≥ 1.15× dense, measured 1.200× (met)" in text
    assert "planned KV-0.25" not in text  # no planned row, no planned target
    data["variants"]["plan-vllm-kv0.25"] = variant(12.9, 4280)
    text = "\n".join(report_serve.serve_section(data))
    assert ("| planned, KV 0.25 (`compress --kv 0.25 --engine vllm --calib-source wiki`) | 12.9 (12.9, 12.9) | 1.290 |"
            in text)
    assert "planned KV-0.25 model (serving issue): throughput ≥ 1.3× dense, measured 1.290× (missed)" in text
    assert "the planned ones on 32 × 512 of wiki" in text  # a result written before serve.py recorded it
    data["planned_calibration"] = {"source": "self+wiki", "windows": 8, "seq_len": 256}
    assert "the planned ones on 8 × 256 of self+wiki (`compress --kv --calib-source self+wiki`)" in "\n".join(
        report_serve.serve_section(data))


def test_plan_seed_spread_reads_the_rows_repeated_with_other_heal_seeds() -> None:
    import report_plan

    def row(wiki: float) -> dict[str, object]:
        return {"ppl_ratio": {"wiki": wiki, "ptb": 2 * wiki, "c4": 3 * wiki}}

    data = {"variants": {"plan-kv0.1-local-heal40-all": row(1.6), "plan-kv0.1-local-heal40-all-seed1": row(1.5),
                         "plan-kv0.1-local-heal40-all-seed2": row(1.8), "mla-kv0.1-local-heal40-all": row(2.4)}}
    lines = report_plan.seed_spread(data)
    assert lines[2] == ("- `plan-kv0.1-local-heal40-all` over heal seeds 0, 1, 2: median (span) wiki 1.600 "
                        "(1.500–1.800), ptb 3.200 (3.000–3.600), c4 4.800 (4.500–5.400).")
    assert len(lines) == 4  # the unrepeated uniform row has no spread line
    del data["variants"]["plan-kv0.1-local-heal40-all-seed1"], data["variants"]["plan-kv0.1-local-heal40-all-seed2"]
    assert report_plan.seed_spread(data) == []
