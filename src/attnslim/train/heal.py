"""Healing: a short logit distillation of a compressed model against the model it was compressed from.

    loss = T² · mean_tokens KL(softmax(z_teacher / T) ‖ softmax(z_student / T))        (every position)
         + hidden · mean_layers mean_tokens ‖h_S − h_T‖² / ‖h_T‖²       (`hidden` > 0: every decoder layer's output)

The hidden-state term (off by default) gives every layer's output a target at every position, b·t·L·d numbers
per batch against b·t distributions for the logits alone; the student runs on its own converted upstream, so
errors that compound through the converted layers are trained against (unlike layer-local matching).
Measured on SmolLM2 at MLA KV 0.25 (BENCHMARKS.md, section MLA: rows mla-kv25-heal40-all-lr3e-4-*, four draws
of the heal data each): with every parameter training, hidden = 10 lowers ptb and c4 in 3 of 4 draws and leaves
wiki unchanged on the median; in single draws it did not help with only the changed tensors training, and on
recipes/mla.yaml's heal at KV 0.5 it traded ptb for wiki and c4. Off by default. The same rows show that the
draw alone moves a 40-step heal's wiki ratio by more than any setting does.

Which parameters train (`params`):
  changed   the tensors compression created or reshaped: a student parameter whose name is missing from the
            teacher or whose shape differs (low-rank factors, latent projections, NBL maps, LISA's q/k/aligner);
            pretrained tensors the methods left as they were stay frozen. The default.
  all       every parameter except the (tied) token embedding.
The teacher is the model before the recipe's first step (api.compress keeps a frozen copy when `heal` is set).
Memory (what a heal holds: the student, the teacher, the optimizer state of the trained tensors only, and the
student's activations for the backward pass through every layer above the first trained one; at 1.5B and
151,936-word vocabularies the logits alone are ~0.6 GB per copy per 1,024 tokens):
  teacher_dtype  bfloat16 casts the teacher, in place, before the first step: half its memory; its logits are
                 cast back to float32 for the KL. Targets move by bfloat16 rounding, so it is opt-in.
  precision      bfloat16: the heal's forward passes (teacher and student) run under bfloat16 autocast: the
                 weights, their gradients, AdamW's state and the loss stay float32, the matmuls run in bfloat16
                 (how GPU training runs). auto: bfloat16 where the device computes it natively (a GPU, a CPU
                 with AVX512-BF16 or AMX: host.native_bf16), else float32. The report records which ran.
  checkpoint     gradient checkpointing of the student's decoder layers (transformers' own, non-reentrant, so
                 that frozen inputs still pass gradients to the trained tensors inside): the activations of one
                 layer at a time instead of all, for one more forward per step. Same gradients up to rounding.
Measured on SmolLM2 (peak RSS of the default recipe's heal, each setting): BENCHMARKS.md, section "Heal memory"
(benchmarks/heal_memory.py, results/heal-memory.json); the precision's time and quality: section "Healing the
default recipe's compression" (rows ...-precisionbfloat16).
Data: steps · batch_size windows of seq_len tokens from the calibration split of `source` (a source or a
mixture such as "wiki+c4"), drawn with seed `seed + 1` so they differ from the statistics windows of the same
seed. AdamW (0.9, 0.999), linear warm-up then cosine decay, gradient clipping 1.0. No checkpoints or resume (unlike
LISA's distill): the heals of the packaged recipes are minutes long (their times: the heal rows of BENCHMARKS.md,
benchmarks/latentllm.py --groups heal and benchmarks/heal.py), so an interrupted heal restarts with the recipe.

A heal that diverges is an error, never a saved model (`check_converged`): it stops at the first step whose loss
is not finite, and at the end it refuses a heal whose mean loss over its last k steps (k = steps/5, 1..10, as in
the report's kl_last) exceeds DIVERGED_FACTOR × the mean over its first k (kl_first) + DIVERGED_MARGIN nats. A
heal is meant to lower its loss, and averaging k steps at each end keeps one hard batch from deciding; the
margin keeps a heal that starts near zero loss from being refused for batch-to-batch noise. A heal at lr 1000 once
saved a model whose perplexity was the vocabulary size (reliability probe case h07,
tests/test_reliability_inputs.py); the settings themselves (settings.HealConfig) must now be finite, with lr <= 1.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attnslim import _compat, host
from attnslim.data import calib_windows
from attnslim.errors import AttnslimError
from attnslim.settings import PARAMS, HealConfig
from attnslim.train.schedule import warmup_cosine

DIVERGED_FACTOR = 2.0  # a heal that ends above this multiple of its starting loss (+ the margin) diverged
DIVERGED_MARGIN = 0.05  # nats


def check_converged(history: list[float], k: int, cfg: HealConfig) -> None:
    """Refuse a diverged heal (module docstring): a non-finite loss, or a last-k mean loss above DIVERGED_FACTOR ×
    the first-k mean + DIVERGED_MARGIN. `history` holds each step's loss so far; the error names both and the fix."""
    fix = (f"lower heal.lr (now {cfg.lr:g}), e.g. to {cfg.lr / 10:g}, or remove heal: to keep the model as the "
           "recipe's steps left it")
    if history and not math.isfinite(history[-1]):
        raise AttnslimError(f"heal diverged: the loss is {history[-1]} at step {len(history) - 1} of {cfg.steps}; "
                            f"nothing was saved; {fix}")
    if len(history) < cfg.steps:
        return
    first, last = sum(history[:k]) / k, sum(history[-k:]) / k
    if last > DIVERGED_FACTOR * first + DIVERGED_MARGIN:
        raise AttnslimError(f"heal diverged: its loss went from {first:.4g} (mean of the first {k} steps) to "
                            f"{last:.4g} (mean of the last {k}), above the {DIVERGED_FACTOR:g}x + "
                            f"{DIVERGED_MARGIN:g} a heal may end at; nothing was saved; {fix}")


def healing_parameters(student: Any, teacher: Any, which: str) -> dict[str, torch.nn.Parameter]:
    """The parameters `which` selects (see the module docstring), by name."""
    if which not in PARAMS:
        raise AttnslimError(f"heal.params={which!r} is invalid; valid: {' | '.join(PARAMS)}")
    embed = student.get_input_embeddings().weight
    if which == "all":
        return {n: p for n, p in student.named_parameters() if p is not embed}
    before = {n: tuple(p.shape) for n, p in teacher.named_parameters()}
    return {n: p for n, p in student.named_parameters() if before.get(n) != tuple(p.shape) and p is not embed}


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · mean over positions of KL(teacher ‖ student) at temperature T; logits (..., vocab)."""
    t = temperature
    s, q = student_logits.float(), teacher_logits.float()
    if t != 1.0:  # at T = 1 (the default) skip two passes over the (n, vocab) logits
        s, q = s / t, q / t
    s = F.log_softmax(s, dim=-1).flatten(0, -2)  # (n, vocab)
    q = F.log_softmax(q, dim=-1).flatten(0, -2)
    return F.kl_div(s, q, log_target=True, reduction="batchmean") * t * t


def hidden_distance(got: tuple[torch.Tensor, ...], target: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and positions of ‖h_S − h_T‖² / ‖h_T‖²; got and target: per layer (b, t, d). Relative
    per position, so massive-activation tokens do not dominate."""
    per_layer = [((s.float() - t.float()) ** 2).sum(-1) / (t.float() ** 2).sum(-1).clamp_min(1e-12)  # (b, t)
                 for s, t in zip(got, target, strict=True)]
    return torch.stack([e.mean() for e in per_layer]).mean()


def heal_precision(cfg: HealConfig, device: torch.device) -> str:
    """The precision the heal runs at on `device`: cfg.precision, with auto resolved (module docstring)."""
    if cfg.precision == "auto":
        return "bfloat16" if host.native_bf16(device) else "float32"
    return cfg.precision


def heal_loss(student: Any, teacher: Any, ids: torch.Tensor, cfg: HealConfig, precision: str = "float32"
              ) -> torch.Tensor:
    """The loss of one batch ids (b, l): logit KL, plus the hidden-state term when cfg.hidden > 0; the forward
    passes under bfloat16 autocast when `precision` is bfloat16 (the KL and distances are taken in float32)."""
    states = cfg.hidden > 0
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        with torch.no_grad():
            want = teacher(input_ids=ids, use_cache=False, output_hidden_states=states)
        got = student(input_ids=ids, use_cache=False, output_hidden_states=states)
    loss = distill_kl(got.logits, want.logits, cfg.temperature)
    if states:  # hidden_states[0] is the (shared, frozen) embedding output
        loss = loss + cfg.hidden * hidden_distance(got.hidden_states[1:], want.hidden_states[1:])
    return loss


def heal_draw(cfg: HealConfig) -> str:
    """How the heal's window count reads in an error: the two settings that make it."""
    return f"heal.steps={cfg.steps} x heal.batch_size={cfg.batch_size}"


def heal(student: Any, teacher: Any, tokenizer: Any, cfg: HealConfig, progress: bool = True) -> dict[str, Any]:
    """Train the selected parameters of `student` towards `teacher`'s logits; returns a JSON-ready report."""
    params = healing_parameters(student, teacher, cfg.params)
    if not params:
        raise AttnslimError("heal: no parameter was changed by compression (params='changed'); nothing to train. "
                            "Use heal.params='all' to fine-tune every parameter")
    windows = calib_windows(cfg.source, tokenizer, cfg.steps * cfg.batch_size, cfg.seq_len, cfg.seed + 1,
                            heal_draw(cfg), model=teacher)
    precision = heal_precision(cfg, next(student.parameters()).device)
    flags = {n: p.requires_grad for n, p in student.named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    teacher.eval()
    if cfg.teacher_dtype == "bfloat16":
        teacher.to(torch.bfloat16)  # in place: the caller's frozen copy, used by nothing after the heal
    was_training = student.training
    history: list[float] = []
    began, cpu_began = time.time(), time.process_time()
    k = max(1, min(10, cfg.steps // 5))  # steps averaged for kl_first and kl_last
    try:
        student.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        student.train()
        with _compat.activation_checkpointing(student) if cfg.checkpoint else nullcontext():
            _train(student, teacher, windows.ids, params, opt, cfg, precision, history, k, progress)
    finally:
        student.train(was_training)
        for n, p in student.named_parameters():
            p.requires_grad_(flags[n])
    return {
        "steps": cfg.steps, "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "data": windows.description,
        "trainable_params": sum(p.numel() for p in params.values()), "tensors": len(params),
        "seconds": round(time.time() - began, 1), "cpu_seconds": round(time.process_time() - cpu_began, 1),
        "config": asdict(cfg), "precision": precision,
        "kl_first": sum(history[:k]) / k, "kl_last": sum(history[-k:]) / k,
        "history": [round(v, 5) for v in history],
    }


def _train(student: Any, teacher: Any, ids_all: torch.Tensor, params: dict[str, torch.nn.Parameter],
           opt: torch.optim.Optimizer, cfg: HealConfig, precision: str, history: list[float], k: int,
           progress: bool) -> None:
    """The heal's steps: one batch of `ids_all` (steps * batch_size, seq_len) each; losses appended to history,
    checked by `check_converged` before each step is taken (k: the steps averaged at either end)."""
    device = next(student.parameters()).device
    for step in tqdm(range(cfg.steps), desc="heal", disable=not progress):
        ids = ids_all[step * cfg.batch_size : (step + 1) * cfg.batch_size].to(device)
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(cfg.lr, cfg.warmup, cfg.steps, step)
        loss = heal_loss(student, teacher, ids, cfg, precision)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        history.append(float(loss.detach()))
        check_converged(history, k, cfg)
        opt.step()
