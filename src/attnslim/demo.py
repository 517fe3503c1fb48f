"""`make demo`: compress the default model with recipes/default.yaml, save, reload, compare before/after."""

from __future__ import annotations

from typing import Any

from attnslim.adapters import get_adapter
from attnslim.bench import kv_bytes_per_token
from attnslim.data import eval_windows
from attnslim.eval import perplexity
from attnslim.generate import generate_text

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
    save(model, tokenizer, out, report.to_json(), overwrite=True)
    del model
    model, tokenizer = load(out)
    after = measure(model, tokenizer, tokens)
    print(format_table(before, after, tokens))
    print(f"\nprompt: {PROMPT!r}\n  dense     : {dense_text!r}")
    print(f"  compressed: {generate_text(model, tokenizer, PROMPT, 30)!r}")
    return 0
