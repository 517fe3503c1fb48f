"""The default recipe's product targets (issue 8) as a pure check over measured numbers.

    kv       KV bytes/token of the compressed model ≤ 0.5 × dense
    total    total parameters ≤ 0.85 × dense
    wiki     wiki perplexity ≤ 1.25 × dense
    acc      every zero-shot task within 3 accuracy points of dense
    decode   decode tokens/s ≥ dense (the two models timed in the same run)

`make demo` prints the check with the measured value of every target and, for a missed one, the measured
reason (`miss_reasons`); benchmarks/composed.py and heal.py record it per recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = {"kv": 0.5, "total": 0.85, "wiki": 1.25, "acc_points": 3.0, "decode": 1.0}


@dataclass(frozen=True)
class TargetCheck:
    key: str
    goal: str  # e.g. "KV bytes/token ≤ 0.5× dense"
    measured: str  # e.g. "0.500×"
    met: bool


def check_targets(kv: float, total: float, wiki: float, acc_drop: dict[str, float], decode: float,
                  decode_span: tuple[float, float] | None = None) -> list[TargetCheck]:
    """Ratios are compressed ÷ dense; acc_drop is dense − compressed accuracy in points, per task. decode is the
    median ratio (what the target is checked on); decode_span, the lowest and highest per-repetition ratio, is
    printed beside it, so a median at the threshold reads as the parity it is."""
    worst = max(acc_drop, key=lambda t: acc_drop[t]) if acc_drop else None
    drops = ", ".join(f"{t} {0.0 - d:+.1f}" for t, d in acc_drop.items())  # 0.0 - d: no "-0.0"
    t = TARGETS
    return [
        TargetCheck("kv", f"KV bytes/token ≤ {t['kv']}× dense", f"{kv:.3f}×", kv <= t["kv"]),
        TargetCheck("total", f"total parameters ≤ {t['total']}× dense", f"{total:.3f}×", total <= t["total"]),
        TargetCheck("wiki", f"wiki perplexity ≤ {t['wiki']}× dense", f"{wiki:.3f}×", wiki <= t["wiki"]),
        TargetCheck("acc", f"zero-shot accuracy within {t['acc_points']:g} points of dense", f"{drops} points",
                    worst is None or acc_drop[worst] <= t["acc_points"]),
        TargetCheck("decode", f"decode tokens/s ≥ {t['decode']}× dense", f"{decode:.2f}×" + (
            f" (repetitions {decode_span[0]:.2f}–{decode_span[1]:.2f}×)" if decode_span else ""),
            decode >= t["decode"]),
    ]


def miss_reasons(params_before: dict[str, int], params_after: dict[str, int], flops_before: dict[str, float],
                 flops_after: dict[str, float], context: int) -> dict[str, str]:
    """Measured explanations for the targets that structure decides (parameters, decode speed).

    params_*: adapter.param_groups(); flops_*: bench.flops_per_token at the decode context.
    """
    share = {g: params_before[g] / params_before["total"] for g in ("embedding", "attention", "mlp")}
    kept = {g: params_after[g] / params_before[g] for g in ("embedding", "attention", "mlp") if params_before[g]}
    core_b, core_a = flops_before["attention_core"], flops_after["attention_core"]
    return {
        "total": ("dense parameters are " + ", ".join(f"{g} {v:.0%}" for g, v in share.items())
                  + "; the compressed model keeps " + ", ".join(f"{g} {k:.2f}×" for g, k in kept.items())),
        "decode": (f"FLOPs per new token at {context} context: {flops_after['total'] / flops_before['total']:.2f}× "
                   f"dense (attention core {core_a / 1e6:.1f} vs {core_b / 1e6:.1f} MFLOPs, linear layers "
                   f"{flops_after['linear'] / flops_before['linear']:.2f}×)"),
    }


def targets_met(checks: list[TargetCheck]) -> dict[str, bool]:
    """{key: met} in the order of TARGETS (benchmarks store this per row)."""
    return {c.key: c.met for c in checks}
