"""Prefill latency and decode speed, measured for several models interleaved in one run (medians, ratios).

Timing discipline (gpt-fast style): warm-up runs first; each repetition times every model once, in turn,
so machine noise hits all models alike; we report medians and the ratio to the first (reference) model, and the
span (min, max) of the per-repetition decode ratios (each model against the reference in the same repetition):
a median at the reference's speed whose span straddles it is parity, not a margin.
Decode is a manual greedy loop over the model's KV cache (what generate() does, minus sampling logic).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from attnslim import _compat


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_prefill_decode(model: Any, ids: torch.Tensor, new_tokens: int, cache_kind: str = "dynamic"
                        ) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) for one prompt ids (1, L), with a fresh HF cache of
    `cache_kind` (_compat.CACHE_KINDS; static: sized for the prompt and the new tokens)."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = _compat.new_cache(model.config, cache_kind, ids.shape[1] + new_tokens)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, **_compat.LAST_LOGITS_ONLY)
    _sync(device)
    prefill = time.perf_counter() - start
    token = out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return prefill, (time.perf_counter() - start) / max(new_tokens, 1)


def interleaved(
    models: dict[str, Any], contexts: list[int], new_tokens: int = 32, repeats: int = 5, warmup: int = 1,
    prompt: Callable[[int], torch.Tensor] | None = None, progress: bool = True, cache_kind: str = "dynamic",
) -> dict[str, Any]:
    """Median prefill latency / decode tokens per second per model and context, plus ratios to the first model."""
    names = list(models)
    vocab = min(int(getattr(models[names[0]].config, "vocab_size", 1000)), 1000)
    make = prompt or (lambda n: torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)))
    device = next(models[names[0]].parameters()).device
    for name, model in models.items():
        _compat.check_positions(model.config, max(contexts) + new_tokens, f"bench {name}: context + new tokens")
    result: dict[str, Any] = {"device": str(device), "contexts": contexts, "new_tokens": new_tokens,
                              "cache": cache_kind, "repeats": repeats, "reference": names[0],
                              "models": {n: {} for n in names}}
    for ctx in contexts:
        ids = make(ctx)
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for rep in range(warmup + repeats):
            for name in names:
                t = time_prefill_decode(models[name], ids, new_tokens, cache_kind)
                if rep >= warmup:
                    samples[name].append(t)
            if progress:
                what = f"warm-up {rep + 1}/{warmup}" if rep < warmup else f"repetition {rep + 1 - warmup}/{repeats}"
                print(f"  context {ctx}: {what}", flush=True)
        for name in names:
            prefill = statistics.median(s[0] for s in samples[name])
            per_token = statistics.median(s[1] for s in samples[name])
            # decode ratio of each repetition: the reference's seconds per token over this model's, same repetition
            paired = [ref[1] / own[1] for ref, own in zip(samples[names[0]], samples[name], strict=True)]
            result["models"][name][str(ctx)] = {"prefill_s": prefill, "decode_tok_s": 1.0 / per_token,
                                                "decode_ratio_span": [min(paired), max(paired)]}
    ref = result["models"][names[0]]
    for name in names:
        for ctx in contexts:
            row = result["models"][name][str(ctx)]
            row["prefill_ratio"] = row["prefill_s"] / ref[str(ctx)]["prefill_s"]
            row["decode_ratio"] = row["decode_tok_s"] / ref[str(ctx)]["decode_tok_s"]
    return result
