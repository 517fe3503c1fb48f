"""A model's parameter groups, KV-cache bytes and per-layer attention description."""

from __future__ import annotations

from typing import Any

from attnslim.adapters import get_adapter
from attnslim.bench import kv_bytes_per_token
from attnslim.bench.kv import no_decode_note


def describe_attention(module: Any) -> dict[str, Any]:
    """Kind, heads and ranks of one attention module (replacement modules provide `describe()`)."""
    if hasattr(module, "describe"):
        return dict(module.describe())
    cfg = getattr(module, "config", None)
    info: dict[str, Any] = {"kind": type(module).__name__}
    if cfg is not None:
        info["heads"] = cfg.num_attention_heads
        info["kv_heads"] = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    ranks = {
        name: sub.rank
        for name, sub in module.named_children()
        if hasattr(sub, "rank")
    }
    if ranks:
        info["ranks"] = ranks
    return info


def inspect_model(model: Any) -> dict[str, Any]:
    adapter = get_adapter(model)
    kv = kv_bytes_per_token(model)
    return {
        "model_type": model.config.model_type,
        "params": adapter.param_groups(),
        "kv_bytes_per_token": kv["total"],
        "no_decode_layers": kv["no_decode"],
        "layers": [
            {"layer": i, **describe_attention(adapter.attention(i)), "kv_bytes_per_token": kv["per_layer"][i]}
            for i in range(adapter.num_layers())
        ],
    }


def format_inspection(info: dict[str, Any]) -> str:
    p = info["params"]
    lines = [
        f"model_type: {info['model_type']}",
        "parameters: " + ", ".join(f"{k} {v:,}" for k, v in p.items()),
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
