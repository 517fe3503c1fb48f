"""`attnslim` commands that make a compressed model: recipes, compress, plan (and compress --kv), demo."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from attnslim.cli_commands import command, emit_json
from attnslim.errors import AttnslimError


@command("recipes")
def cmd_recipes(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from attnslim.recipe_catalog import catalog, default_results_dir, format_catalog

    results = default_results_dir() if args.results is None else args.results.expanduser()
    if args.results is not None and not results.is_dir():
        raise AttnslimError(f"--results {args.results}: not a directory; give the folder of the benchmark results "
                            "(a source checkout's benchmarks/results)")
    entries = catalog(results)
    print(format_catalog(entries, results))
    if args.json:
        emit_json({"results": str(results), "recipes": [asdict(e) for e in entries]})
    return 0


@command("compress")
def cmd_compress(args: argparse.Namespace) -> int:

    from attnslim.api import compress_to
    from attnslim.recipe import apply_overrides, load_recipe

    if args.kv is not None:
        return _compress_planned(args)
    _refuse_plan_options(args)
    recipe = apply_overrides(load_recipe(args.recipe or "default"), args.set)
    # compress_to checks the recipe, the input and --out before it loads anything
    report = compress_to(args.model, recipe, Path(args.out), args.overwrite, args.offload, args.device, args.dtype)
    _print_compressed(report, args)
    return 0


def _refuse_plan_options(args: argparse.Namespace) -> None:
    """A planner option given without --kv would be ignored: refuse it instead, naming it."""
    from attnslim.cli_parsers import add_plan_options

    defaults = argparse.ArgumentParser(add_help=False)
    add_plan_options(defaults)
    given = [a.option_strings[0] for a in defaults._actions if getattr(args, a.dest) != a.default]
    if given:
        verb = "configures" if len(given) == 1 else "configure"
        raise AttnslimError(f"{', '.join(given)} {verb} the planner, which runs only with --kv; add --kv F (the "
                            "kept fraction of the KV cache), or drop them to compress with the recipe")


def _print_compressed(report: Any, args: argparse.Namespace) -> None:
    from attnslim.bench.kv import no_decode_note

    summary = report.summary()
    for group, ratio in summary["kept_ratio"].items():
        print(f"{group:>9}: {report.params_before[group]:>12,} -> {report.params_after[group]:>12,}  ({ratio:.3f})")
    kv = summary["kv_bytes_per_token"]
    print(f"KV cache: {kv['before']:,.0f} -> {kv['after']:,.0f} bytes/token"
          f"{no_decode_note(summary['no_decode_layers'])}; {summary['seconds']} s; "
          f"peak RSS {summary['peak_rss_mb']} MB; saved to {args.out}")
    if args.json:
        emit_json({"out": args.out, **summary})


def plan_config(args: argparse.Namespace) -> Any:
    """The planner's settings from `plan`/`compress --kv` arguments, checked before any model is loaded."""
    from attnslim.planner.candidates import DEFAULT_KINDS, DEFAULT_LADDER, DEFAULT_MLA_ARGS
    from attnslim.planner.run import PlanConfig, standard_heal
    from attnslim.recipe import Calibration

    for flag, value, low in (("--decode-at", args.decode_at, 1), ("--calib-windows", args.calib_windows, 1),
                             ("--score-windows", args.score_windows, 1), ("--rounds", args.rounds, 0),
                             ("--local-steps", args.local_steps, 0), ("--fit-steps", args.fit_steps, 0)):
        if value < low:
            raise AttnslimError(f"{flag} {value}: give an integer >= {low}")
    kinds = tuple(k.strip() for k in args.candidates.split(",")) if args.candidates else DEFAULT_KINDS
    ladder = tuple(parse_floats("--ladder", args.ladder)) if args.ladder else DEFAULT_LADDER
    source, note = calibration_source(args.calib_source, args.offload)
    calibration = Calibration(source=source, windows=args.calib_windows, seq_len=512)
    mla_args = {**DEFAULT_MLA_ARGS, "local_steps": args.local_steps} if args.local_steps else None
    cfg = PlanConfig(kv=args.kv, params=args.params, decode_bytes=args.decode_bytes, decode_at=args.decode_at,
                     engine=args.engine, kinds=kinds, ladder=ladder, score_windows=args.score_windows,
                     refine_windows=args.score_windows, rounds=args.rounds, calibration=calibration, mla_args=mla_args,
                     heal=standard_heal(calibration.source) if args.heal else None, fit_steps=args.fit_steps)
    if note:  # after the settings are checked: a refused command line prints its error alone
        print(note, file=sys.stderr)
    return cfg


def calibration_source(given: str | None, offload: bool) -> tuple[str, str | None]:
    """The planner's calibration text: `given`, else its default with the note to print (on stderr: `--json` output
    stays JSON). The default is `self+wiki` (planner.run.PLAN_SOURCE: why there), and wiki with --offload, where the
    dense model stays on disk and cannot sample its own text."""
    from attnslim.planner.run import OFFLOAD_SOURCE, PLAN_SOURCE

    if given is not None:
        return given, None
    if offload:
        return OFFLOAD_SOURCE, (
            f"attnslim: --offload: calibrating on {OFFLOAD_SOURCE}, not the default {PLAN_SOURCE} (sampling the "
            "model's own text needs it whole in memory); a model with a domain of its own (code, another language) "
            "keeps it better with --calib-source wiki+file:PATH, that domain's text")
    return PLAN_SOURCE, (
        f"attnslim: calibrating on {PLAN_SOURCE} (the default): text the model samples itself beside Wikipedia, "
        "which keeps a model's own domain (code, another language); --calib-source wiki+file:PATH uses your "
        "domain's text, --calib-source wiki Wikipedia alone (docs/planning.md, 'Calibration that follows the "
        "model')")


def parse_floats(flag: str, text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AttnslimError(f"{flag} {text!r}: give comma-separated numbers, e.g. 0.25,0.5,0.75") from None


@command("plan")
def cmd_plan(args: argparse.Namespace) -> int:

    from attnslim.api_checks import refuse_compressed
    from attnslim.planner.candidates import SHARING
    from attnslim.planner.output import check_plan_out, load_planned, offloaded_for_plan, plan_table, write_plan
    from attnslim.planner.run import plan_model, refuse_offloaded_plan

    cfg = plan_config(args)
    out = Path(args.out)
    check_plan_out(out)
    refuse_compressed(args.model)
    if args.offload:
        if args.candidates is None:  # the default set without sharing, which an offloaded plan cannot measure
            cfg = replace(cfg, kinds=tuple(k for k in cfg.kinds if k not in SHARING))
            print(f"attnslim: --offload: candidates {','.join(cfg.kinds)} (sharing needs two layers in memory)")
        refuse_offloaded_plan(cfg)  # before the checkpoint is read
        with offloaded_for_plan(args.model, args.dtype, args.device) as (model, tokenizer, residency):
            result = plan_model(model, tokenizer, cfg, residency=residency)
    else:
        model, tokenizer = load_planned(args.model, args.dtype, args.device)
        result = plan_model(model, tokenizer, cfg)
    report_path = write_plan(result, out)
    print("\n".join(plan_table(result.report)))
    print(f"plan written to {out} (report: {report_path}); {result.report['seconds']['total']:.0f} s")
    if args.json:
        emit_json({"out": str(out), "report": str(report_path), "used": result.report["used"],
                   "estimate": result.report["estimate"], "seconds": result.report["seconds"]})
    return 0


def _compress_planned(args: argparse.Namespace) -> int:
    """`compress --kv F`: plan, then compress the same model with the plan (planner/output.py)."""

    from attnslim.api_checks import refuse_compressed
    from attnslim.outdir import check_output
    from attnslim.planner.output import plan_and_compress, plan_table

    if args.recipe is not None or args.set:
        raise AttnslimError("--kv plans the recipe itself; drop --recipe/--set, or write the plan with `attnslim plan "
                            "... --out plan.yaml`, edit it, and compress with --recipe plan.yaml")
    if args.offload:
        raise AttnslimError("--kv plans and compresses with the whole model in memory on --device; for a model "
                            "larger than memory, plan with `attnslim plan MODEL --kv F --offload --out plan.yaml`, "
                            "then compress with --recipe plan.yaml --offload")
    cfg = plan_config(args)
    refuse_compressed(args.model)
    check_output(Path(args.out), args.overwrite, inputs=[Path(args.model)])
    result, report = plan_and_compress(args.model, cfg, Path(args.out), args.overwrite, args.dtype,
                                       device=args.device)
    print("\n".join(plan_table(result.report)))
    _print_compressed(report, args)
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from attnslim.demo import TASK_LIMIT, run_demo

    limit = TASK_LIMIT if args.task_limit is None else args.task_limit
    if limit < 0:
        raise AttnslimError(f"--task-limit {limit}: use 0 (every item) or a positive number of items")
    return run_demo(args.model, args.recipe, args.out, args.tokens, limit or None, overwrite=args.overwrite)
