"""`make demo`: compress the default model with recipes/default.yaml, save, reload, compare before/after:
perplexity, zero-shot accuracy, parameters, KV bytes/token and decode speed (dense and compressed interleaved in
one run), then the report and a generation from both models."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from attnslim import _compat, host
from attnslim.adapters import get_adapter
from attnslim.bench import interleaved, kv_bytes_per_token
from attnslim.bench.flops import flops_per_token
from attnslim.data import eval_windows
from attnslim.eval import perplexity
from attnslim.eval.lmeval_run import evaluate_standard
from attnslim.eval.standard import materialise
from attnslim.eval.tasks import TASK_DIR
from attnslim.generate import generate_text
from attnslim.io import read_compression_json, write_compression_json
from attnslim.modules.cpu_linear import set_cpu_linear
from attnslim.report import write_report
from attnslim.targets import check_targets, miss_reasons
from attnslim.user_cache import cache_root

SOURCES = ("wiki", "ptb", "c4")
# two of the standard suite's tasks, scored by lm-eval itself (eval/lmeval_run.py) on their first TASK_LIMIT items,
# the same items for both models, each accuracy printed with its standard error and n: they replace the home-made
# cloze tasks of earlier demos at about the same cost; `attnslim eval --tasks standard` scores the whole suite
TASKS = ("arc_easy", "piqa")
PROMPT = "The history of the city begins"
# the demo's measurements are a quick before/after within its 6-minute budget: 3 interleaved decode repetitions and
# 1024 perplexity tokens per text (cli_parsers); BENCHMARKS.md's runs (8192 tokens, more repetitions) hold the figures
SPEED = {"context": 512, "new_tokens": 32, "repeats": 3}
# items per task: scoring is most of the demo's evaluation time (piqa's 50 items are 100 requests, arc_easy's 200)
TASK_LIMIT = 50


def measure(model: Any, tokenizer: Any, tokens: int, task_limit: int | None) -> dict[str, Any]:
    ppl = {s: perplexity(model, eval_windows(s, tokenizer, tokens, 512), label=s).ppl for s in SOURCES}
    scores = evaluate_standard(model, tokenizer, list(TASKS), materialise(cache_root(), TASK_DIR), task_limit)["tasks"]
    return {"ppl": ppl, "acc": {name: r["acc"] for name, r in scores.items()},
            "stderr": {name: r["acc_stderr"] for name, r in scores.items()},
            "items": {name: r["n"] for name, r in scores.items()},
            "params": get_adapter(model).param_groups(), "kv": kv_bytes_per_token(model)["total"]}


def inference_kernel(model: Any) -> str:
    """The linear kernel the demo measures both models with: oneDNN on a CPU where torch's MKL runs generic code
    (AMD) and the torch build has oneDNN's linear op, else torch's own. Both models alike, so every ratio stays
    fair; compression and the heal always run on torch's (docs/cpu-speed.md, "CPU speed")."""
    on_cpu = _compat.input_device(model).type == "cpu"
    return "onednn" if on_cpu and host.mkl_runs_generic_code() and host.onednn_linear_available() else "torch"


def decode_speed(dense: Any, compressed: Any) -> dict[str, float]:
    """Median decode tokens/s of both models, interleaved in this run, at SPEED's context, and the lowest and
    highest per-repetition ratio (ratio_low, ratio_high)."""
    ctx = SPEED["context"]
    res = interleaved({"dense": dense, "compressed": compressed}, [ctx], new_tokens=SPEED["new_tokens"],
                      repeats=SPEED["repeats"], progress=False)
    rows = {name: res["models"][name][str(ctx)] for name in ("dense", "compressed")}
    low, high = rows["compressed"]["decode_ratio_span"]
    return {"dense": rows["dense"]["decode_tok_s"], "compressed": rows["compressed"]["decode_tok_s"],
            "ratio_low": low, "ratio_high": high}


def table_rows(before: dict[str, Any], after: dict[str, Any], speed: dict[str, float], tokens: int
               ) -> list[tuple[str, float, float, str]]:
    """(metric, dense, compressed, number format) rows of the before/after comparison."""
    rows = [(f"{s} ppl ({tokens} tok)", before["ppl"][s], after["ppl"][s], ".3f") for s in SOURCES]
    rows += [(f"{t} acc ({before['items'][t]} items)", before["acc"][t], after["acc"][t], ".3f") for t in TASKS]
    rows += [(f"{g} params", before["params"][g], after["params"][g], ",") for g in ("attention", "mlp", "total")]
    rows.append(("KV bytes/token", before["kv"], after["kv"], ",.0f"))
    rows.append((f"decode tok/s @{SPEED['context']}", speed["dense"], speed["compressed"], ".2f"))
    return rows


def format_table(rows: list[tuple[str, float, float, str]]) -> str:
    out = [f"{'':<30}{'dense':>14}{'compressed':>14}{'ratio':>9}"]
    for name, b, a, fmt in rows:
        out.append(f"{name:<30}{b:>14{fmt}}{a:>14{fmt}}{a / b if b else float('nan'):>9.3f}")
    return "\n".join(out)


def target_lines(before: dict[str, Any], after: dict[str, Any], speed: dict[str, float], dense: Any, compressed: Any
                 ) -> list[str]:
    """The issue-8 targets, met or missed, each with its measured value; a missed one also with its reason."""
    checks = check_targets(
        kv=after["kv"] / before["kv"], total=after["params"]["total"] / before["params"]["total"],
        wiki=after["ppl"]["wiki"] / before["ppl"]["wiki"],
        acc_drop={t: 100 * (before["acc"][t] - after["acc"][t]) for t in TASKS},
        decode=speed["compressed"] / speed["dense"],
        decode_span=(speed["ratio_low"], speed["ratio_high"]))
    ctx = SPEED["context"]
    reasons = miss_reasons(before["params"], after["params"], flops_per_token(dense, ctx),
                           flops_per_token(compressed, ctx), ctx)
    lines = []
    for c in checks:
        lines.append(f"  [{'met' if c.met else 'MISSED'}] {c.goal}: {c.measured}")
        if not c.met and c.key in reasons:
            lines.append(f"           why: {reasons[c.key]}")
    return lines


class Stages:
    """Wall seconds of the demo's stages in order (printed at the end, kept in compression.json as demo_seconds:
    benchmarks/demo_time.py reads them against the 6-minute budget)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 1)
        self._last = now

    def line(self) -> str:
        return f"demo wall time: {time.perf_counter() - self._start:.0f} s (" + ", ".join(
            f"{name} {s:.0f} s" for name, s in self.seconds.items()) + ")"


def record_metrics(out: str, rows: list[tuple[str, float, float, str]], tokens: int,
                   stages: dict[str, float], kernel: str) -> None:
    """Add the measured before/after metrics and the demo's stage times to compression.json (the report reads
    the metrics)."""
    info = read_compression_json(Path(out))  # the demo's own output, just written
    info["metrics"] = {name: {"before": b, "after": a} for name, b, a, _ in rows if "params" not in name}
    info["demo_seconds"] = stages
    info["metrics_description"] = (
        f"perplexity: first {tokens} tokens of each evaluation split, 512-token windows; zero-shot: "
        f"{', '.join(TASKS)} (lm-eval, 0-shot, acc on the first items, n in each name); decode: "
        f"greedy, {SPEED['new_tokens']} new tokens after {SPEED['context']} "
        f"context, median of {SPEED['repeats']} interleaved repetitions on the CPU; linear layers of both models "
        f"on {'oneDNN' if kernel == 'onednn' else 'torch'}")
    write_compression_json(Path(out), info)


def run_demo(model_name: str, recipe_name: str, out: str, tokens: int, task_limit: int | None = TASK_LIMIT,
             overwrite: bool = False) -> int:
    from attnslim.api import check_recipe, compress
    from attnslim.api_checks import refuse_compressed
    from attnslim.io import load, save
    from attnslim.models import load_model
    from attnslim.outdir import check_output
    from attnslim.recipe import load_recipe

    stages = Stages()
    recipe = load_recipe(recipe_name)
    methods = check_recipe(recipe)
    refuse_compressed(model_name)
    check_output(Path(out), overwrite, inputs=[Path(model_name)])  # before minutes of measuring and compressing
    print(f"== attnslim demo: {model_name} with recipe {recipe.name!r}: {recipe.description}", flush=True)
    model, tokenizer = load_model(model_name)
    kernel = inference_kernel(model)
    if kernel == "onednn":
        print("this CPU is not Intel's, so torch's MKL runs generic code: both models are measured with their linear "
              "layers on oneDNN (docs/cpu-speed.md); compression and the heal run on torch's own", flush=True)
    set_cpu_linear(model, kernel)
    before = measure(model, tokenizer, tokens, task_limit)
    dense_text = generate_text(model, tokenizer, PROMPT, 30)
    set_cpu_linear(model, "torch")
    stages.lap("measure dense")
    report = compress(model, tokenizer, recipe, methods=methods)
    stages.lap("compress")
    healed = f", heal {report.heal['seconds']:.0f} s at {report.heal['precision']}" if report.heal else ""
    print(f"compressed in {report.seconds:.0f} s{healed} (peak RSS {report.peak_rss_mb:.0f} MB); saving to {out}")
    save(model, tokenizer, out, {**report.to_json(), "base_model": model_name}, overwrite=overwrite)
    del model
    model, tokenizer = load(out)
    set_cpu_linear(model, kernel)
    stages.lap("save and reload")
    after = measure(model, tokenizer, tokens, task_limit)
    stages.lap("measure compressed")
    dense, _ = load_model(model_name)
    set_cpu_linear(dense, kernel)
    speed = decode_speed(dense, model)
    stages.lap("decode speed")
    rows = table_rows(before, after, speed, tokens)
    print(format_table(rows))
    print("accuracy ± its standard error: " + "; ".join(
        f"{t} {before['acc'][t]:.3f} ± {before['stderr'][t]:.3f} -> {after['acc'][t]:.3f} ± {after['stderr'][t]:.3f}"
        for t in TASKS))
    print("targets of the default recipe:\n" + "\n".join(target_lines(before, after, speed, dense, model)))
    print(f"\nprompt: {PROMPT!r}\n  dense     : {dense_text!r}")
    print(f"  compressed: {generate_text(model, tokenizer, PROMPT, 30)!r}")
    stages.lap("generation")
    record_metrics(out, rows, tokens, stages.seconds, kernel)
    html, _ = write_report(out)
    print(f"report: {html}")
    print(f"\nfull evaluation (every task item, 8192 tokens per text): attnslim eval {out} --data {','.join(SOURCES)} "
          f"--tasks standard; the same for {model_name}; speed: attnslim bench {out} --vs "
          f"{model_name}")
    print(f"to choose a method per layer under a KV budget instead: attnslim compress {model_name} --kv 0.5 --heal "
          "--out out/planned (it measures every candidate of every layer first, which takes longer than this demo "
          "on a CPU; docs/planning.md says why the demo keeps the default recipe)")
    if kernel == "onednn":
        print("the same on this CPU for bench, eval or generate: add --cpu-linear onednn (docs/cpu-speed.md)")
    print(stages.line())
    return 0
