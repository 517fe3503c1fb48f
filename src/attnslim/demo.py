"""`make demo`: compress the default model with recipes/default.yaml, save, reload, compare before/after."""

from __future__ import annotations

from typing import Any

from attnslim.adapters import get_adapter
from attnslim.bench import kv_bytes_per_token
from attnslim.data import eval_windows
from attnslim.eval import perplexity
from attnslim.generate import generate_text
from attnslim.io import COMPRESSION_JSON
from attnslim.report import write_report

SOURCES = ("wiki", "ptb", "c4")
PROMPT = "The history of the city begins"


def measure(model: Any, tokenizer: Any, tokens: int) -> dict[str, Any]:
    ppl = {s: perplexity(model, eval_windows(s, tokenizer, tokens, 512), label=s).ppl for s in SOURCES}
    return {"ppl": ppl, "params": get_adapter(model).param_groups(), "kv": kv_bytes_per_token(model)["total"]}


def format_table(before: dict[str, Any], after: dict[str, Any], tokens: int) -> str:
    rows = [f"{'':<26}{'dense':>14}{'compressed':>14}{'ratio':>9}"]
    for s in SOURCES:
        b, a = before["ppl"][s], after["ppl"][s]
        rows.append(f"{s + ' ppl (' + str(tokens) + ' tok)':<26}{b:>14.3f}{a:>14.3f}{a / b:>9.3f}")
    for group in ("attention", "mlp", "total"):
        b, a = before["params"][group], after["params"][group]
        rows.append(f"{group + ' params':<26}{b:>14,}{a:>14,}{a / b:>9.3f}")
    rows.append(f"{'KV bytes/token':<26}{before['kv']:>14,.0f}{after['kv']:>14,.0f}{after['kv'] / before['kv']:>9.3f}")
    return "\n".join(rows)


def record_metrics(out: str, before: dict[str, Any], after: dict[str, Any], tokens: int) -> None:
    """Add the measured before/after perplexities to compression.json (the report reads them)."""
    import json
    from pathlib import Path

    path = Path(out) / COMPRESSION_JSON
    info = json.loads(path.read_text())
    info["metrics"] = {f"{s} ppl": {"before": before["ppl"][s], "after": after["ppl"][s]} for s in SOURCES}
    info["metrics_description"] = f"first {tokens} tokens of each evaluation split, 512-token windows"
    path.write_text(json.dumps(info, indent=1))


def run_demo(model_name: str, recipe_name: str, out: str, tokens: int) -> int:
    from attnslim.api import compress
    from attnslim.io import load, save
    from attnslim.models import load_model
    from attnslim.recipe import load_recipe

    recipe = load_recipe(recipe_name)
    print(f"== attnslim demo: {model_name} with recipe {recipe.name!r}: {recipe.description}", flush=True)
    model, tokenizer = load_model(model_name)
    before = measure(model, tokenizer, tokens)
    dense_text = generate_text(model, tokenizer, PROMPT, 30)
    report = compress(model, tokenizer, recipe)
    print(f"compressed in {report.seconds:.0f} s (peak RSS {report.peak_rss_mb:.0f} MB); saving to {out}")
    info = report.to_json()
    save(model, tokenizer, out, info, overwrite=True)
    del model
    model, tokenizer = load(out)
    after = measure(model, tokenizer, tokens)
    print(format_table(before, after, tokens))
    record_metrics(out, before, after, tokens)
    html, _ = write_report(out)
    print(f"report: {html}")
    print(f"\nprompt: {PROMPT!r}\n  dense     : {dense_text!r}")
    print(f"  compressed: {generate_text(model, tokenizer, PROMPT, 30)!r}")
    return 0
