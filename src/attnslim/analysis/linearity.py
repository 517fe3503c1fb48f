"""NBL's motivating analysis: how linear is each attention block? (seed 003, Algorithm 1's ranking step.)

For every layer of the dense model: the paper's CCA bound Σ(1 − ρ²), the in-sample LMMSE fit error (NMSE,
what the bound bounds), the fit error relative to the residual stream (`resid`, attnslim's default
criterion) and LLM-Drop's cosine score; then the m layers each criterion would linearize. Statistics are
streamed layer by layer (calib.runner) from the calibration windows; the model is not changed.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from attnslim.adapters import get_adapter
from attnslim.calib.runner import LayerRunner
from attnslim.data import calib_windows
from attnslim.methods.nbl import CRITERIA, DEFAULT_CRITERION, MEASURED, SCORES, Nbl

_SELECTIONS = tuple(c for c in CRITERIA if c not in ("given", MEASURED))  # read from the statistics alone


@torch.no_grad()
def linearity_report(model: Any, tokenizer: Any, calibration: dict[str, Any], m: int,
                     input: str = "normed", progress: bool = False) -> dict[str, Any]:
    """Per-layer scores (SCORES) of the dense model and each criterion's selection of `m` layers.

    `calibration`: {"source", "windows", "seq_len", "seed"[, "batch_size"]} as in a recipe.
    """
    adapter = get_adapter(model)
    n_layers = adapter.num_layers()
    Nbl(m=m).count(n_layers)  # validates m before any statistics are collected
    cal = {"seed": 0, "batch_size": 4, **calibration}
    windows = calib_windows(cal["source"], tokenizer, int(cal["windows"]), int(cal["seq_len"]), int(cal["seed"]),
                            f"windows={cal['windows']}")
    runner = LayerRunner(model, adapter, windows.ids, int(cal["batch_size"]))
    method = Nbl(m=m, input=input)
    fits: dict[int, Any] = {}
    for i in tqdm(range(n_layers), desc="linearity", disable=not progress, leave=False):
        collector = method.collector(adapter, i)
        runner.run_layer(i, collector.sites, collector, advance=True)
        fits[i] = collector.result()
    scores = {i: fits[i].scores for i in range(n_layers)}
    return {
        "model": getattr(model.config, "name_or_path", "") or model.config.model_type,
        "calibration": {"description": windows.description, "tokens": windows.n_tokens, **cal},
        "input": input,
        "m": m,
        "default_criterion": DEFAULT_CRITERION,
        "layers": [{"layer": i, **{s: scores[i][s] for s in SCORES}, "cond": fits[i].info.cond}
                   for i in range(n_layers)],
        "selection": {c: Nbl(m=m, criterion=c, input=input).select(scores, m) for c in _SELECTIONS},
    }


def format_linearity(report: dict[str, Any]) -> str:
    """Plain-text table: one row per layer, a bar of the default criterion, `*` where it selects the layer."""
    default = report["default_criterion"]
    chosen = set(report["selection"][default])
    cca_chosen = set(report["selection"]["cca"])
    rows = report["layers"]
    top = max(r[default] for r in rows) or 1.0
    lines = [
        f"NBL linearity of {report['model']} ({report['calibration']['description']}, "
        f"{report['calibration']['tokens']} tokens, input={report['input']})",
        "  cca: paper's bound sum(1 - rho^2) (lower = more linear); nmse: LMMSE fit error / tr(C_YY);",
        "  resid: fit error relative to the residual stream, per token (attnslim's default); "
        "similarity: 1 - cos(h, h + attn)",
        f"{'layer':>5} {'cca':>9} {'nmse':>7} {'resid':>9} {'similar':>8}  sel  {default} (bar)",
    ]
    for r in rows:
        mark = ("*" if r["layer"] in chosen else " ") + ("c" if r["layer"] in cca_chosen else " ")
        bar = "#" * max(1, round(30 * r[default] / top))
        lines.append(f"{r['layer']:>5} {r['cca']:>9.3f} {r['nmse']:>7.4f} {r['resid']:>9.2e} "
                     f"{r['similarity']:>8.4f}  {mark}   {bar}")
    lines.append(f"selection for m={report['m']} (* = {default}, c = cca):")
    for criterion, layers in report["selection"].items():
        lines.append(f"  {criterion:<10} {layers}")
    return "\n".join(lines)
