"""What the report says, as text: the base model, which way each metric is better, the heal's result, the summary.

Read from compression.json and the directory's config.json only (no model is loaded to write a report).
"""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePath
from typing import Any

from attnslim.disk_format import BASE_TYPE_KEY
from attnslim.report.text import fmt, fmt_float, layer_ranges
from attnslim.safe_files import read_json

_LOWER = re.compile(r"\bppl\b|perplexity|\bloss\b|\bnll\b|\bkl\b|bytes|params|latency|\bms\b|seconds|memory|error",
                    re.IGNORECASE)
_HIGHER = re.compile(r"\bacc|accuracy|tok/s|tokens/s|throughput|\bf1\b|exact.match", re.IGNORECASE)
_SPEED = re.compile(r"tok/s|tokens/s|throughput|latency|\bms\b|seconds", re.IGNORECASE)
_SIZE = re.compile(r"bytes|params", re.IGNORECASE)


def read_config(directory: Path) -> dict[str, Any]:
    """The saved config.json ({} when the directory has none)."""
    path = directory / "config.json"
    if not path.exists() and not path.is_symlink():
        return {}
    config = read_json(path, "config.json")
    return config if isinstance(config, dict) else {}


def model_name(info: dict[str, Any], config: dict[str, Any]) -> str:
    """The base model's name: compression.json's `base_model` if recorded, else the name the config was loaded
    from (a local path shortened to its last component)."""
    name = info.get("base_model") or config.get("_name_or_path") or ""
    name = str(name.get("name", "") if isinstance(name, dict) else name)
    if name.startswith(("/", ".", "~")) or "\\" in name:
        name = PurePath(name.replace("\\", "/")).name
    return name or "name not recorded"


def model_text(info: dict[str, Any], config: dict[str, Any]) -> str:
    """"smollm2-135m (llama, 30 layers, hidden 576, 9 heads / 3 KV heads, float32, 134,515,008 parameters)"."""
    details = [config.get(BASE_TYPE_KEY) or config.get("model_type")]
    for key, unit in (("num_hidden_layers", "layers"), ("hidden_size", "hidden")):
        if key in config:
            details.append(f"{config[key]} {unit}" if unit == "layers" else f"{unit} {config[key]}")
    if "num_attention_heads" in config:
        kv = config.get("num_key_value_heads") or config["num_attention_heads"]
        details.append(f"{config['num_attention_heads']} heads / {kv} KV heads")
    details.append(config.get("torch_dtype") or config.get("dtype"))
    details.append(f"{info['params_before']['total']:,} parameters")
    return f"{model_name(info, config)} ({', '.join(str(d) for d in details if d)})"


def better(name: str, entry: dict[str, Any]) -> str | None:
    """"lower" or "higher" is better for a metric (an entry's own `better` wins), None when the name does not say."""
    if entry.get("better") in ("lower", "higher"):
        return str(entry["better"])
    if _HIGHER.search(name):
        return "higher"
    return "lower" if _LOWER.search(name) else None


def kind(name: str) -> str:
    """"speed", "size" or "quality": where a metric goes in the summary."""
    return "speed" if _SPEED.search(name) else "size" if _SIZE.search(name) else "quality"


def ratio(entry: dict[str, Any]) -> float:
    return float(entry["after"]) / float(entry["before"]) if entry.get("before") else math.nan


def verdict(name: str, entry: dict[str, Any]) -> str:
    """"+10.0% (worse)", "-3.2% (better)", "+0.0% (unchanged)" or "+5.0%" when the direction is unknown."""
    r = ratio(entry)
    if not math.isfinite(r):
        return "n/a (dense value is 0)"
    way = better(name, entry)
    word = ("unchanged" if abs(r - 1) < 5e-4 else "better" if way and (r < 1) == (way == "lower")
            else "worse" if way else "")
    return f"{100 * (r - 1):+.1f}%" + (f" ({word})" if word else "")


def sample_size(entry: dict[str, Any]) -> str:
    """The number of items/tokens a metric was measured on, if the entry records it."""
    for key, unit in (("n", ""), ("items", " items"), ("samples", " samples"), ("tokens", " tokens")):
        if isinstance(entry.get(key), int | float):
            return f"{fmt(entry[key])}{unit}"
    return ""


def metric_line(name: str, entry: dict[str, Any]) -> str:
    n = sample_size(entry)
    return (f"{name} {fmt_float(float(entry['before']))} → {fmt_float(float(entry['after']))} "
            f"{verdict(name, entry)}" + (f", n = {n}" if n else ""))


def _steps(k: int) -> str:
    return f"{k} steps" if k > 1 else "step"


def heal_text(heal: dict[str, Any] | None) -> str:
    """One line on the heal: steps, tokens and the distillation KL at its start and end."""
    if not heal:
        return "none (the recipe has no heal step)"
    k = max(1, min(10, len(heal.get("history", [])) // 5))
    return (f"{heal['steps']} steps on {heal['tokens']:,} tokens, {heal['trainable_params']:,} parameters trained; "
            f"KL to the dense model {fmt_float(heal['kl_first'])} → {fmt_float(heal['kl_last'])} (mean of the first "
            f"and last {_steps(k)}), {heal['seconds']} s")


def heal_pairs(heal: dict[str, Any]) -> list[tuple[str, str]]:
    """The heal's report as (name, text) rows."""
    cfg = heal.get("config", {})
    k = max(1, min(10, len(heal.get("history", [])) // 5))
    rows = [("steps", f"{heal['steps']} × {cfg.get('batch_size', '?')} windows of {cfg.get('seq_len', '?')} tokens "
                      f"= {heal['tokens']:,} tokens"),
            ("data", str(heal.get("data", ""))),
            ("trained", f"{heal['trainable_params']:,} parameters in {heal.get('tensors', '?')} tensors "
                        f"(params = {cfg.get('params', '?')})"),
            ("KL to the dense model", f"{fmt_float(heal['kl_first'])} → {fmt_float(heal['kl_last'])} (mean of the "
                                      f"first and last {_steps(k)})"),
            ("time", f"{heal['seconds']} s")]
    settings = {k: v for k, v in cfg.items() if k not in ("steps", "batch_size", "seq_len", "params")}
    rows.append(("settings", ", ".join(f"{k} {fmt(v)}" for k, v in settings.items())))
    return rows


def summary(info: dict[str, Any], config: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's first table: model, what was done, KV saving, quality cost, speed, heal."""
    before, after = info["params_before"], info["params_after"]
    kb, ka = info["kv_bytes_per_token_before"], info["kv_bytes_per_token_after"]
    recipe = info["recipe"]
    steps = "; ".join(f"{s['method']} on layers {layer_ranges([int(k) for k in s['plan'].get('layers', {})])}"
                      for s in info["steps"])
    rows = [("base model", model_text(info, config)),
            ("recipe", f"{recipe.get('name')}: {recipe.get('description', '')}".rstrip(": ")),
            ("steps", steps or "none"),
            ("KV cache", f"{kb:,.0f} → {ka:,.0f} bytes/token, {ka / kb:.1%} kept ({1 - ka / kb:.1%} saved)"
             if kb else "no KV cache"),
            ("parameters", ", ".join(f"{g} {after[g] / before[g]:.1%} kept" for g in ("attention", "mlp", "total")
                                     if before.get(g)))]
    metrics = info.get("metrics") or {}
    for group in ("quality", "speed"):
        lines = [metric_line(k, v) for k, v in metrics.items() if kind(k) == group]
        rows.append((f"{group}", "; ".join(lines) if lines else "not measured (run attnslim eval / bench; the demo "
                     "records both)"))
    if info.get("no_decode_layers"):
        rows.append(("generation", f"not possible: layers {layer_ranges(info['no_decode_layers'])} see the whole "
                     "sequence (no causal decode)"))
    rows.append(("heal", heal_text(info.get("heal"))))
    return rows
