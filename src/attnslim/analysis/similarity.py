"""LISA's motivating analyses (paper §3-4): how similar is attention across layers?

similarity_report: A1 Jensen-Shannon divergence of head-averaged attention between every pair of layers;
  A2 per-head JS of adjacent layers under direct / random / most-similar (oracle, per window) / global
  (one matching for all windows: what a fixed aligner can reach) head matching; A3 cosine similarity of X,
  Q, K, V, scores A, probabilities P, P·V and the output across adjacent layers.
sensitivity_report: A4 the loss change when layer k's attention is replaced by the previous layer's
  (DS) or by uniform causal attention (AVG), for k alone ("single") and for k..L-1 ("suffix", the paper's
  cumulative protocol); layers whose donor has another attention type (Gemma-3's global layers and the sliding
  layer after each) cannot share and are left out of both sweeps and both modes (the report's "skipped").
JS (gap 17): divergence with natural log (max ln 2), fp32, eps 1e-10, mean over every query row.
Inputs: the first n windows of the source's evaluation split; attention is recomputed from each layer's
AttentionSpec on the inputs captured by pre-hooks (exact for unchanged layers, any attention backend).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.data import eval_windows
from attnslim.eval.perplexity import window_nll
from attnslim.linalg.scores import spec_qkv_scores
from attnslim.methods.lisa import temporary_sharing, unshareable_layers
from attnslim.modules.shared import SharingConfig

PARTS = ("x", "q", "k", "v", "scores", "probs", "pv", "out")
EPS = 1e-10
RANDOM_PERMUTATIONS = 5


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise JS divergence (natural log) of distributions p, q (..., t) -> (...)."""
    m = 0.5 * (p + q)
    log_m = torch.log(m + EPS)
    kl_p = (p * (torch.log(p + EPS) - log_m)).sum(-1)
    kl_q = (q * (torch.log(q + EPS) - log_m)).sum(-1)
    return 0.5 * (kl_p + kl_q)


@contextmanager
def attention_inputs(model: Any) -> Iterator[dict[int, tuple[torch.Tensor, Any]]]:
    """Capture each layer's attention input x (b, l, hidden) and position embeddings during a forward."""
    adapter = get_adapter(model)
    store: dict[int, tuple[torch.Tensor, Any]] = {}
    handles = []

    def hook(i: int) -> Any:
        def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = _compat.hidden_states_arg(args, kwargs)
            store[i] = (x.detach(), kwargs.get("position_embeddings"))

        return capture

    try:
        for i in range(adapter.num_layers()):
            handles.append(adapter.attention(i).register_forward_pre_hook(hook(i), with_kwargs=True))
        yield store
    finally:
        for h in handles:
            h.remove()


def attention_parts(spec: Any, x: torch.Tensor, cos_sin: Any) -> dict[str, torch.Tensor]:
    """One unpadded window x (1, l, hidden) -> the sub-module states of A3 (causal mask, no padding)."""
    q, k, v, scores = spec_qkv_scores(spec, x, cos_sin)  # (1, h, l, d), (1, g, l, d) x2, (1, h, l, l)
    l = x.shape[1]
    keep = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
    probs = torch.softmax(scores.float().masked_fill(~keep, float("-inf")), dim=-1)  # (1, h, l, l)
    groups = spec.n_heads // spec.n_kv_heads
    pv = probs.to(v.dtype) @ v.repeat_interleave(groups, dim=1)  # (1, h, l, d)
    pv = pv.transpose(1, 2).reshape(1, l, -1)  # (1, l, h*d)
    out = torch.nn.functional.linear(pv, spec.o, spec.o_bias)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # (1, n, l, d) -> (l, n*d)
        return t[0].transpose(0, 1).reshape(l, -1)

    def rows(t: torch.Tensor) -> torch.Tensor:  # (1, h, l, l) -> (l, h*l), masked entries 0
        return t[0].masked_fill(~keep, 0.0).transpose(0, 1).reshape(l, -1)

    return {"x": x[0], "q": tokens(q), "k": tokens(k), "v": tokens(v), "scores": rows(scores.float()),
            "probs": probs[0], "pv": pv[0], "out": out[0]}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())


def _flat_probs(p: torch.Tensor) -> torch.Tensor:
    return p.transpose(0, 1).reshape(p.shape[1], -1)  # (h, l, l) -> (l, h*l)


@torch.no_grad()
def similarity_report(
    model: Any, tokenizer: Any, source: str = "wiki", n: int = 8, seq_len: int = 256, progress: bool = True
) -> dict[str, Any]:
    """A1-A3 on the first n windows of seq_len tokens of `source`'s evaluation split."""
    adapter = get_adapter(model)
    n_layers = adapter.num_layers()
    specs = [adapter.attention_spec(i) for i in range(n_layers)]
    h = specs[0].n_heads
    windows = eval_windows(source, tokenizer, n * seq_len, seq_len)
    device = _compat.input_device(model)
    gen = torch.Generator().manual_seed(0)
    perms = [torch.randperm(h, generator=gen) for _ in range(RANDOM_PERMUTATIONS)]
    js_sum = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    cost_sum = torch.zeros(n_layers - 1, h, h, dtype=torch.float64)  # C[n-1][a, b] = JS(P_n^a, P_{n-1}^b)
    match = {k: torch.zeros(n_layers - 1, dtype=torch.float64) for k in ("direct", "random", "oracle")}
    cos = {p: torch.zeros(n_layers - 1, dtype=torch.float64) for p in PARTS}
    for w in tqdm(range(windows.ids.shape[0]), desc="similarity", disable=not progress, leave=False):
        with attention_inputs(model) as inputs:
            model(input_ids=windows.ids[w : w + 1].to(device), use_cache=False)
        parts = [attention_parts(specs[i], *inputs[i]) for i in range(n_layers)]
        mean_p = torch.stack([p["probs"].mean(0) for p in parts])  # (L, l, l)
        for a in range(n_layers):
            js_sum[a] += js_divergence(mean_p[a][None], mean_p).mean(-1).double().cpu()
        for i in range(1, n_layers):
            cur, prev = parts[i]["probs"], parts[i - 1]["probs"]  # (h, l, l)
            c = js_divergence(cur[:, None], prev[None]).mean(-1).double().cpu()  # (h, h)
            cost_sum[i - 1] += c
            match["direct"][i - 1] += c.diagonal().mean()
            match["random"][i - 1] += torch.stack([c[torch.arange(h), pi].mean() for pi in perms]).mean()
            match["oracle"][i - 1] += c.min(dim=1).values.mean()
            for name in PARTS:
                a_, b_ = parts[i - 1][name], parts[i][name]
                if name == "probs":
                    a_, b_ = _flat_probs(a_), _flat_probs(b_)
                cos[name][i - 1] += _cos(a_, b_)
    count = windows.ids.shape[0]
    mean_cost = cost_sum / count
    report: dict[str, Any] = {
        "source": source, "windows": count, "seq_len": seq_len, "description": windows.description,
        "layers": n_layers, "heads": h, "js": "natural log, fp32, eps 1e-10, mean over query rows",
        "js_matrix": (js_sum / count).tolist(),
        "head_matching": {k: (v / count).tolist() for k, v in match.items()},
        "cosine": {k: (v / count).tolist() for k, v in cos.items()},
    }
    hm = report["head_matching"]
    hm["global"] = mean_cost.min(dim=2).values.mean(1).tolist()
    hm["global_match"] = mean_cost.argmin(dim=2).tolist()  # per adjacent pair: head a of n -> best head of n-1
    report["summary"] = _similarity_summary(report)
    return report


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def adjacent_js(js: list[list[float]]) -> list[float]:
    """The adjacent-pair profile of an (L, L) JS matrix: JS(l, l+1) for l = 0..L-2 (L-1 values)."""
    return [js[i][i + 1] for i in range(len(js) - 1)]


def mean_pair_js(js: list[list[float]]) -> float:
    """The mean JS of an (L, L) matrix over every pair of distinct layers (the heat map without its diagonal)."""
    n = len(js)
    return _mean([js[i][j] for i in range(n) for j in range(n) if i != j])


def _similarity_summary(r: dict[str, Any]) -> dict[str, Any]:
    js = r["js_matrix"]
    n = len(js)
    adjacent = adjacent_js(js)
    distant = [js[i][j] for i in range(n) for j in range(n) if abs(i - j) >= 4]
    row_means = [_mean([js[i][j] for j in range(n) if j != i]) for i in range(n)]
    hm = r["head_matching"]
    return {
        "adjacent_js_mean": _mean(adjacent), "distant_js_mean": _mean(distant),
        "most_dissimilar_layer": max(range(n), key=lambda i: row_means[i]),
        "head_js_mean": {k: _mean(hm[k]) for k in ("direct", "random", "oracle", "global")},
        "oracle_below_direct_pairs": sum(o < d for o, d in zip(hm["oracle"], hm["direct"], strict=True)),
        "cosine_mean": {k: _mean(v) for k, v in r["cosine"].items()},
    }


@torch.no_grad()
def _mean_nll(model: Any, ids: torch.Tensor) -> float:
    device = _compat.input_device(model)
    total, count = 0.0, 0
    for w in range(ids.shape[0]):
        nll, k = window_nll(model, ids[w : w + 1].to(device))
        total, count = total + nll, count + k
    return total / count


@torch.no_grad()
def sensitivity_report(
    model: Any, tokenizer: Any, source: str = "wiki", n: int = 4, seq_len: int = 256,
    modes: tuple[str, ...] = ("ds", "avg"), sweeps: tuple[str, ...] = ("single", "suffix"), progress: bool = True,
) -> dict[str, Any]:
    """A4: mean NLL increase when attention of layer k (single) or layers k..L-1 (suffix) deviates; never a layer
    of `unshareable_layers` (no entry for it, and a suffix shares only the others)."""
    adapter = get_adapter(model)
    n_layers, skip = adapter.num_layers(), unshareable_layers(adapter)
    windows = eval_windows(source, tokenizer, n * seq_len, seq_len)
    base = _mean_nll(model, windows.ids)
    cfgs = {"ds": SharingConfig(), "avg": SharingConfig(uniform=True)}
    out: dict[str, Any] = {"source": source, "windows": windows.ids.shape[0], "seq_len": seq_len,
                           "description": windows.description, "base_nll": base, "base_ppl": math.exp(base),
                           "skipped": sorted(skip)}
    shareable = [k for k in range(1, n_layers) if k not in skip]
    jobs = [(s, m, k) for s in sweeps for m in modes for k in shareable]
    for sweep, mode, k in tqdm(jobs, desc="sensitivity", disable=not progress, leave=False):
        layers = [k] if sweep == "single" else [i for i in shareable if i >= k]
        with temporary_sharing(adapter, {i: cfgs[mode] for i in layers}):
            delta = _mean_nll(model, windows.ids) - base
        out.setdefault(sweep, {}).setdefault(mode, {})[str(k)] = delta
    return out


def sensitivity_cost(report: dict[str, Any], mode: str = "ds") -> dict[int, float]:
    """Single-layer loss increases as a cost for `methods.lisa.select_layers`."""
    return {int(k): v for k, v in report["single"][mode].items()}


# --- text formatters -----------------------------------------------------------------------------
_SHADES = " .:-=+*#%@"


def format_similarity(r: dict[str, Any]) -> str:
    js = r["js_matrix"]
    n = len(js)
    top = max(max(row) for row in js) or 1.0
    lines = [f"Attention similarity: {r['description']}; JS = {r['js']}",
             f"A1 head-averaged JS between layers (0 = ' ', {top:.3f} = '@'):",
             "     " + "".join(str(j % 10) for j in range(n))]
    for i, row in enumerate(js):
        lines.append(f"{i:>4} " + "".join(_SHADES[min(9, int(9.999 * v / top))] for v in row))
    hm, cs = r["head_matching"], r["cosine"]
    lines.append("")
    lines.append("pair    JS(avg)  direct  random  oracle  global | cos: " + " ".join(f"{p:>6}" for p in PARTS))
    for i in range(n - 1):
        head = f"{i:>2}-{i + 1:<3} {js[i][i + 1]:>8.4f} " + " ".join(
            f"{hm[k][i]:>7.4f}" for k in ("direct", "random", "oracle", "global"))
        lines.append(head + " |      " + " ".join(f"{cs[p][i]:>6.3f}" for p in PARTS))
    s = r["summary"]
    lines.append("")
    lines.append(f"adjacent mean JS {s['adjacent_js_mean']:.4f} vs |i-j|>=4 mean {s['distant_js_mean']:.4f}; "
                 f"most dissimilar layer {s['most_dissimilar_layer']}")
    lines.append("per-head JS means: " + ", ".join(f"{k} {v:.4f}" for k, v in s["head_js_mean"].items())
                 + f"; oracle < direct in {s['oracle_below_direct_pairs']}/{n - 1} pairs")
    lines.append("adjacent cosine means: " + ", ".join(f"{k} {v:.3f}" for k, v in s["cosine_mean"].items()))
    return "\n".join(lines)


def format_sensitivity(r: dict[str, Any]) -> str:
    lines = [f"Sensitivity (mean NLL increase, nats/token): {r['description']}; base ppl {r['base_ppl']:.3f}"]
    cols = [(s, m) for s in ("single", "suffix") if s in r for m in r[s]]
    lines.append("layer " + " ".join(f"{s + ':' + m:>12}" for s, m in cols))
    layers = sorted({int(k) for s, m in cols for k in r[s][m]})
    for k in layers:
        lines.append(f"{k:>5} " + " ".join(f"{r[s][m].get(str(k), float('nan')):>12.4f}" for s, m in cols))
    return "\n".join(lines)
