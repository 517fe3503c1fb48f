"""A model's parameter groups, KV-cache bytes and per-layer attention description."""

from __future__ import annotations

from typing import Any

from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.bench import kv_bytes_per_token
from attnslim.bench.kv import no_decode_note
from attnslim.registry import ADAPTERS  # filled by importing attnslim.adapters above


def describe_attention(adapter: Adapter, i: int) -> dict[str, Any]:
    """Kind, heads and ranks of layer i's attention module (replacement modules provide `describe()`)."""
    module: Any = adapter.attention(i)
    if hasattr(module, "describe"):
        return dict(module.describe())
    heads = adapter.attention_heads(i)  # from the config: svd/asvd/svdllm layers have no dense q to read a spec from
    info: dict[str, Any] = {"kind": type(module).__name__, "heads": heads.n_heads, "kv_heads": heads.n_kv_heads}
    ranks = {
        name: sub.rank
        for name, sub in module.named_children()
        if hasattr(sub, "rank")
    }
    if ranks:
        info["ranks"] = ranks
    return info


def parameter_groups(model: Any) -> tuple[dict[str, int | None], str]:
    """(groups, note): the parameter groups of a family attnslim has an adapter for; for another (a DeepSeek-V3
    export, which transformers runs natively) only the total, counted from the tensors (tied ones once), with the
    groups None and a note saying why. Perplexity and the KV cache need no adapter, so `eval` reports them for any
    causal LM transformers loads instead of failing after printing a perplexity (reliability round 3, e37)."""
    model_type = str(getattr(model.config, "model_type", None))
    if model_type in ADAPTERS:
        return dict(get_adapter(model).param_groups()), ""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    groups: dict[str, int | None] = {"attention": None, "mlp": None, "embedding": None, "other": None, "total": total}
    return groups, f" (attention/MLP split not counted: attnslim has no adapter for model_type {model_type!r})"


def inspect_model(model: Any) -> dict[str, Any]:
    adapter = get_adapter(model)
    kv = kv_bytes_per_token(model)
    return {
        "model_type": model.config.model_type,
        "params": adapter.param_groups(),
        "kv_bytes_per_token": kv["total"],
        "head": describe_head(adapter),
        "no_decode_layers": kv["no_decode"],
        "layers": [
            {"layer": i, **describe_attention(adapter, i), "kv_bytes_per_token": kv["per_layer"][i]}
            for i in range(adapter.num_layers())
        ],
    }


def describe_head(adapter: Adapter) -> str:
    """The LM head's module and shape (a factored head shows its rank), and whether it is the embedding's tensor."""
    head = adapter.output_head()
    return f"{type(head).__name__}({head.extra_repr()})" + (", tied to the embedding" if adapter.head_tied() else "")


def format_inspection(info: dict[str, Any]) -> str:
    p = info["params"]
    lines = [
        f"model_type: {info['model_type']}",
        "parameters: " + ", ".join(f"{k} {v:,}" for k, v in p.items()),
        f"LM head: {info['head']}",
        f"KV cache: {info['kv_bytes_per_token']:,.0f} bytes/token (measured from the cache)"
        + no_decode_note(info.get("no_decode_layers", [])),
        f"{'layer':>5}  {'attention':<24} {'heads':>5} {'kv':>3} {'KV B/tok':>9}  ranks",
    ]
    for row in info["layers"]:
        ranks = row.get("ranks", "")
        lines.append(
            f"{row['layer']:>5}  {row['kind']:<24} {row.get('heads', ''):>5} {row.get('kv_heads', ''):>3} "
            f"{row['kv_bytes_per_token']:>9,.0f}  {ranks}"
        )
    return "\n".join(lines)
