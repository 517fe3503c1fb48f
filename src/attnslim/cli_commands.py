"""The subcommands of `attnslim` (each a few lines over the API) and their small parsing helpers; their
arguments are declared in cli_parsers.py."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from attnslim.errors import AttnslimError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn

    return deco


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, default=float), flush=True)


def parse_sources(text: str) -> list[str]:
    from attnslim.data import SOURCES

    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SOURCES and not name.startswith("file:"):
            raise AttnslimError(f"unknown text source {name!r}; valid: {', '.join(SOURCES)}, file:PATH")
    return names


def parse_ints(flag: str, text: str) -> list[int]:
    """Comma-separated ints ("512,2048"), or an error naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AttnslimError(f"{flag} {text!r}: expected comma-separated integers, e.g. 512,2048") from None


def load_placed(name: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """A model on --device (whole, or one decoder layer at a time with --offload), its linear layers on
    --cpu-linear."""
    from attnslim.bench.report import default_device
    from attnslim.models import load_model
    from attnslim.modules.cpu_linear import set_cpu_linear
    from attnslim.offload import resolve_device

    device = resolve_device(args.device or default_device())
    if args.offload:
        if args.cpu_linear != "torch":
            raise AttnslimError(f"--cpu-linear {args.cpu_linear} with --offload is not supported: the offloaded "
                                "layers' weights arrive per call; drop one of the two")
        return load_model(name, offload=True, device=device)
    model, tokenizer = load_model(name)
    model = model.to(device)
    if args.cpu_linear != "torch":
        set_cpu_linear(model, args.cpu_linear)
    return model, tokenizer


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    from attnslim.bench import kv_bytes_per_token
    from attnslim.bench.kv import no_decode_note
    from attnslim.data import check_lengths, eval_windows
    from attnslim.data.sources import check_source
    from attnslim.errors import AttnslimError
    from attnslim.eval import perplexity
    from attnslim.eval.choice import choice_accuracy, choice_items
    from attnslim.eval.lmeval_run import check_limit, evaluate_standard, format_rows
    from attnslim.eval.standard import materialise, split_tasks
    from attnslim.eval.tasks import TAG, TASK_DIR, evaluate_tasks, task_names
    from attnslim.inspect import parameter_groups
    from attnslim.models.zoo import cache_root

    # unknown names, a bad --limit, missing data or lm-eval: all fail before the model loads
    standard, tasks = split_tasks(args.tasks, task_names(), TAG) if args.tasks is not None else ([], [])
    if args.limit is not None and args.limit < 1:
        raise AttnslimError(f"eval: --limit must be >= 1 (or left out for every item), got {args.limit}")
    task_dir = materialise(cache_root(), TASK_DIR) if standard else None
    counts = check_limit(standard, args.limit) if standard else {}
    only_scores = tasks or standard or args.choice is not None  # perplexity by default only when no score is asked for
    if args.data is not None and not parse_sources(args.data):
        raise AttnslimError(f"--data {args.data!r} names no text source; give e.g. --data wiki,ptb or leave it out")
    sources = parse_sources(args.data if args.data is not None else "" if only_scores else "wiki,ptb,c4")
    check_lengths(args.seq_len, args.tokens)
    check_source("--choice-source", args.choice_source)
    if args.batch_size < 1 or (args.choice is not None and (args.choice < 1 or args.choice_context < 1)):
        raise AttnslimError(f"eval: need --batch-size ≥ 1, --choice ≥ 1 and --choice-context ≥ 1; got "
                            f"{args.batch_size}, {args.choice}, {args.choice_context}")
    model, tokenizer = load_placed(args.model, args)
    choice = None
    if args.choice is not None:
        items = choice_items(args.choice_source, tokenizer, n=args.choice, context=args.choice_context)
        res = choice_accuracy(model, items)
        choice = {"acc": res.acc, "acc_norm": res.acc_norm, "n": res.items, "source": args.choice_source}
        print(f"choice: acc {res.acc:.4f}  acc_norm {res.acc_norm:.4f}  ({res.description}, answer at the last "
              "position)", flush=True)
    ppl, tokens = {}, {}
    for source in sources:
        result = perplexity(model, eval_windows(source, tokenizer, args.tokens, args.seq_len))
        ppl[source], tokens[source] = result.ppl, result.predicted_tokens
        print(f"{source:>6}: ppl {result.ppl:9.3f}  ({result.description})", flush=True)
    scores = evaluate_tasks(model, tokenizer, tasks, args.limit, args.batch_size) if tasks else {}
    for name, s in scores.items():
        print(f"{name}: acc {s['acc']:.4f}  acc_norm {s['acc_norm']:.4f}  ({s['n']} items)", flush=True)
    std = None
    if standard and task_dir is not None:
        std = evaluate_standard(model, tokenizer, standard, task_dir, args.limit, args.batch_size, counts=counts)
        print(f"standard tasks (lm-eval {std['lm_eval']}, 0-shot, acc ± standard error):")
        print("\n".join(format_rows(std)), flush=True)
    params, note = parameter_groups(model)
    measured = kv_bytes_per_token(model)
    kv = measured["total"]
    print(f"params: {params['total']:,}{note}  KV cache: {kv:,.0f} bytes/token{no_decode_note(measured['no_decode'])}")
    if args.json:
        emit_json({
            "model": args.model, "ppl": ppl, "tokens": tokens, "seq_len": args.seq_len, "tasks": scores,
            "standard": std, "choice": choice,
            "params": {k: params[k] for k in ("total", "attention", "mlp", "embedding")},
            "kv_bytes_per_token": kv, "no_decode_layers": measured["no_decode"],
        })
    return 0


@command("tasks")
def cmd_tasks(args: argparse.Namespace) -> int:
    from attnslim.eval.standard import SUITES, TASKS, data_dir, materialise, task_size
    from attnslim.eval.tasks import TAG, TASK_DIR, load_items, task_names
    from attnslim.models.zoo import cache_root

    if args.path:  # written into the cache: its YAMLs hold the absolute paths of lm-eval's tasks and of the data
        print(materialise(cache_root(), TASK_DIR))
        return 0
    print("standard (lm-eval's own task definitions, local data):")
    data = data_dir()
    for std in TASKS.values():
        note = "" if std.split == std.lm_eval_split else f" (lm-eval scores {std.lm_eval_split}, which does not ship)"
        print(f"  {std.name:<24} {task_size(std.name, data):>6} items, {std.split} split{note}")
    for suite, members in SUITES.items():
        print(f"  suite {suite}: {','.join(members)}")
    print("home-made (attnslim's scorer, checked equal to lm-eval's):")
    for name in task_names():
        print(f"  {name:<24} {len(load_items(name)):>6} items, 4 choices (tag {TAG})")
    print("lm-eval: lm_eval --model hf --model_args pretrained=DIR --include_path $(attnslim tasks --path) "
          "--tasks arc_easy,... (any task above)")
    return 0


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from attnslim.inspect import format_inspection, inspect_model
    from attnslim.models import load_model

    model, _ = load_model(args.model)
    info = inspect_model(model)
    print(format_inspection(info))
    if args.json:
        emit_json(info)
    return 0


@command("compress")
def cmd_compress(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnslim.api import check_recipe, compress_to
    from attnslim.models import refuse_compressed_input
    from attnslim.outdir import check_output
    from attnslim.recipe import apply_overrides, load_recipe

    if args.kv is not None:
        return _compress_planned(args)
    recipe = apply_overrides(load_recipe(args.recipe or "default"), args.set)
    check_recipe(recipe)  # refuse before spending seconds loading and minutes compressing
    refuse_compressed_input(args.model)
    check_output(Path(args.out), args.overwrite, inputs=[Path(args.model)])
    report = compress_to(args.model, recipe, Path(args.out), args.overwrite, args.offload, args.device, args.dtype)
    _print_compressed(report, args)
    return 0


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
    from attnslim.planner.candidates import DEFAULT_KINDS, DEFAULT_LADDER, candidate_set
    from attnslim.planner.run import PlanConfig
    from attnslim.planner.solve import Budget
    from attnslim.recipe import Calibration

    for flag, value in (("--kv", args.kv), ("--params", args.params), ("--decode-bytes", args.decode_bytes)):
        if value is not None:
            Budget({"--kv": "kv", "--params": "params", "--decode-bytes": "decode"}[flag], value, 1.0)
    for flag, value, low in (("--decode-at", args.decode_at, 1), ("--calib-windows", args.calib_windows, 1),
                             ("--score-windows", args.score_windows, 1), ("--rounds", args.rounds, 0)):
        if value < low:
            raise AttnslimError(f"{flag} {value}: give an integer >= {low}")
    kinds = tuple(k.strip() for k in args.candidates.split(",")) if args.candidates else DEFAULT_KINDS
    ladder = tuple(parse_floats("--ladder", args.ladder)) if args.ladder else DEFAULT_LADDER
    candidate_set(kinds, ladder, args.engine)  # unknown kinds or ladder values are refused here
    return PlanConfig(kv=args.kv, params=args.params, decode_bytes=args.decode_bytes, decode_at=args.decode_at,
                      engine=args.engine, kinds=kinds, ladder=ladder, score_windows=args.score_windows,
                      refine_windows=args.score_windows, rounds=args.rounds,
                      calibration=Calibration(source=args.calib_source, windows=args.calib_windows, seq_len=512))


def parse_floats(flag: str, text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AttnslimError(f"{flag} {text!r}: give comma-separated numbers, e.g. 0.25,0.5,0.75") from None


@command("plan")
def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnslim.models import refuse_compressed_input
    from attnslim.models.load import load_model
    from attnslim.planner.output import check_plan_out, plan_table, write_plan
    from attnslim.planner.run import plan_model

    cfg = plan_config(args)
    out = Path(args.out)
    check_plan_out(out)
    refuse_compressed_input(args.model)
    model, tokenizer = load_model(args.model)
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
    from pathlib import Path

    from attnslim.models import refuse_compressed_input
    from attnslim.outdir import check_output
    from attnslim.planner.output import plan_and_compress, plan_table

    if args.recipe is not None or args.set:
        raise AttnslimError("--kv plans the recipe itself; drop --recipe/--set, or write the plan with `attnslim plan "
                            "... --out plan.yaml`, edit it, and compress with --recipe plan.yaml")
    if args.offload or args.device != "cpu":
        raise AttnslimError("--kv plans and compresses in memory on the CPU; for --offload or --device, write the "
                            "plan with `attnslim plan` and compress with --recipe plan.yaml")
    cfg = plan_config(args)
    refuse_compressed_input(args.model)
    check_output(Path(args.out), args.overwrite, inputs=[Path(args.model)])
    result, report = plan_and_compress(args.model, cfg, Path(args.out), args.overwrite, args.dtype)
    print("\n".join(plan_table(result.report)))
    _print_compressed(report, args)
    return 0


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    from attnslim.errors import AttnslimError
    from attnslim.generate import NonFiniteLogits, generate_text

    if not args.prompt.strip():
        raise AttnslimError("--prompt is empty; give the text to continue, e.g. --prompt 'The history of'")
    model, tokenizer = load_placed(args.model, args)
    try:
        text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens)
    except NonFiniteLogits as err:  # name where the NaN/Inf is, as eval does
        from attnslim.eval.perplexity import nonfinite_site

        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        raise AttnslimError(f"{err}: {nonfinite_site(model, ids)}") from None
    print(text)
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from attnslim.demo import TASK_LIMIT, run_demo

    limit = TASK_LIMIT if args.task_limit is None else args.task_limit
    if limit < 0:
        raise AttnslimError(f"--task-limit {limit}: use 0 (every item) or a positive number of items")
    return run_demo(args.model, args.recipe, args.out, args.tokens, limit or None, overwrite=args.overwrite)


ANALYSES = ("linearity", "lowrank", "similarity", "sensitivity", "conversion")


def _method_from_cli(name: str, items: list[str]) -> Any:
    """A method instance from --method and its --arg KEY=VALUE items (values parsed as YAML)."""
    from attnslim.errors import AttnslimError
    from attnslim.methods import lookup_method
    from attnslim.recipe import yaml_value

    args = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise AttnslimError(f"--arg {item!r} must look like key=value, e.g. --arg rank=0.25")
        args[key] = yaml_value(raw, f"--arg {item}")
    return lookup_method(name).from_args(args)


# the analyses that read a fixed small sample whatever --windows / --seq-len ask (their cost grows with L²·layers)
SAMPLE_CAPS = {"lowrank": (8, None), "similarity": (8, 256), "sensitivity": (4, 256), "conversion": (None, 256)}


def _capped(args: argparse.Namespace) -> None:
    """Say when an analysis reads fewer windows or shorter ones than asked (never a silent clamp)."""
    windows, seq_len = SAMPLE_CAPS.get(args.what, (None, None))
    for name, cap, asked in (("--windows", windows, args.windows), ("--seq-len", seq_len, args.seq_len)):
        if cap is not None and asked > cap:
            print(f"analyze: --what {args.what} reads at most {cap} for {name}; using {cap} (asked {asked})",
                  file=sys.stderr, flush=True)


def _cap(asked: int, what: str, which: int) -> int:
    """`asked` limited by SAMPLE_CAPS[what][which] (0: windows, 1: seq_len), the one place the caps are written."""
    cap = SAMPLE_CAPS[what][which]
    return asked if cap is None else min(asked, cap)


def _analysis(args: argparse.Namespace, model: Any, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """Run one analysis; (report, text table)."""
    _capped(args)
    if args.what == "linearity":
        from attnslim.analysis.linearity import format_linearity, linearity_report

        calibration = {"source": args.source, "windows": args.windows, "seq_len": args.seq_len, "seed": 0}
        report = linearity_report(model, tokenizer, calibration, args.m)
        return report, format_linearity(report)
    if args.what == "lowrank":
        from attnslim.analysis.lowrank import format_lowrank, lowrank_report

        report = lowrank_report(model, tokenizer, args.source, n=_cap(args.windows, "lowrank", 0))
        return report, format_lowrank(report)
    if args.what == "conversion":
        from attnslim.adapters import get_adapter
        from attnslim.analysis.conversion import conversion_report, format_conversion
        from attnslim.recipe import resolve_layers, selector_from_text

        method = _method_from_cli(args.method, args.arg)
        layers = resolve_layers(selector_from_text(args.layers), get_adapter(model).num_layers())
        report = conversion_report(model, tokenizer, method, args.source, n=args.windows,
                                   context=_cap(args.seq_len, "conversion", 1), layers=layers)
        return report, format_conversion(report)
    from attnslim.analysis import similarity

    if args.what == "similarity":
        report = similarity.similarity_report(model, tokenizer, args.source, n=_cap(args.windows, "similarity", 0),
                                              seq_len=_cap(args.seq_len, "similarity", 1))
        return report, similarity.format_similarity(report)
    report = similarity.sensitivity_report(model, tokenizer, args.source, n=_cap(args.windows, "sensitivity", 0),
                                           seq_len=_cap(args.seq_len, "sensitivity", 1))
    return report, similarity.format_sensitivity(report)


@command("analyze")
def cmd_analyze(args: argparse.Namespace) -> int:
    from attnslim.errors import AttnslimError
    from attnslim.models import load_model

    if args.what not in ANALYSES:
        raise AttnslimError(f"unknown analysis {args.what!r}; valid: {', '.join(ANALYSES)}")
    if (args.arg or args.layers != "all") and args.what != "conversion":
        raise AttnslimError(f"--arg and --layers are read by --what conversion only, not {args.what!r}")
    if args.what == "conversion":
        from attnslim.recipe import selector_from_text

        _method_from_cli(args.method, args.arg)  # bad method arguments and selectors fail before the model loads
        selector_from_text(args.layers)
    if args.plot:
        check_plot_path(args.plot)
    model, tokenizer = load_model(args.model)
    report, text = _analysis(args, model, tokenizer)
    print(text)
    if args.plot:
        from pathlib import Path

        from attnslim.analysis.plots import analysis_svg

        Path(args.plot).write_text(analysis_svg(args.what, report))
        print(f"figures: {args.plot}")
    if args.json:
        emit_json(report)
    return 0


def check_plot_path(plot: str) -> None:
    """--plot's file can be written: its directory exists and is writable, and it is not a directory itself;
    checked before the model loads, not after the analysis ran (reliability round 3, a07)."""
    import os
    from pathlib import Path

    path = Path(plot).expanduser()
    parent = path.parent
    if path.is_dir():
        raise AttnslimError(f"--plot {plot}: is a directory; give a file name such as {path / 'figures.svg'}")
    if not parent.is_dir():
        raise AttnslimError(f"--plot {plot}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AttnslimError(f"--plot {plot}: the directory {parent} is not writable; choose another path")


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    from attnslim.bench.report import bench_models, format_bench
    from attnslim.errors import AttnslimError

    contexts = parse_ints("--contexts", args.contexts)
    if args.repeats < 1 or args.new_tokens < 1 or not contexts or min(contexts) < 1:
        raise AttnslimError(f"bench: need --repeats ≥ 1, --new-tokens ≥ 1 and contexts ≥ 1; got --repeats "
                            f"{args.repeats}, --new-tokens {args.new_tokens}, --contexts {args.contexts!r}")
    models = {}
    if args.vs:
        models[args.vs] = load_placed(args.vs, args)
    models[args.model] = load_placed(args.model, args)
    result = bench_models(models, contexts, args.new_tokens, args.repeats)
    print(format_bench(result))
    if args.json:
        emit_json(result)
    return 0


@command("report")
def cmd_report(args: argparse.Namespace) -> int:
    from attnslim.report import write_report

    html, md = write_report(args.directory)
    print(f"wrote {html} and {md}")
    return 0


@command("export")
def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnslim.export import ExportOptions, export_deepseek
    from attnslim.export.deepseek import check_kv_lora_rank_in
    from attnslim.io import load
    from attnslim.outdir import check_output

    source, out = Path(args.directory), Path(args.out)
    check_output(out, args.overwrite, inputs=[source])  # before loading: a bad --out is found in a second
    options = ExportOptions(kv_lora_rank=args.kv_lora_rank, dtype=args.dtype, drop_biases=args.drop_biases)
    check_kv_lora_rank_in(source, args.kv_lora_rank)  # before loading too
    model, tokenizer = load(source)
    report = export_deepseek(model, tokenizer, out, options, args.overwrite, source)
    kv, dense = report["kv_elements_per_token_and_layer"], report["dense_kv_elements_per_token_and_layer"]
    print(f"wrote {out} (DeepseekV3ForCausalLM, kv_lora_rank {report['kv_lora_rank']} + qk_rope_head_dim "
          f"{report['qk_rope_head_dim']}: KV {kv} values per token and layer, {kv / dense:.3f}x the dense {dense}; "
          f"{args.dtype}); verified by transformers on {report['verified_on']}: "
          f"relative logit error {report['relative_logit_error']:.1e}, top-1 agreement "
          f"{report['top1_agreement']:.3f}, NLL {report['nll_source']:.4f} -> {report['nll_export']:.4f}")
    if args.json:
        emit_json({"out": str(out), **report})
    return 0


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    from attnslim.serving.launch import ServeArgs, serve

    serve(ServeArgs(args.model, args.host, args.port, args.api_key, args.dtype, args.max_model_len, args.kv_cache_gib,
                    args.api_key_file, args.no_api_key))
    return 0  # not reached: serve() execs vLLM
