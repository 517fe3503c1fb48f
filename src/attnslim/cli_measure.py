"""`attnslim` commands that use or measure a model: eval, tasks, inspect, generate, bench, report."""

from __future__ import annotations

import argparse

from attnslim.cli_commands import command, emit_json, load_placed, parse_ints
from attnslim.errors import AttnslimError


def parse_sources(text: str) -> list[str]:
    from attnslim.data import SOURCES

    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SOURCES and not name.startswith("file:"):
            raise AttnslimError(f"unknown text source {name!r}; valid: {', '.join(SOURCES)}, file:PATH")
    return names


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
