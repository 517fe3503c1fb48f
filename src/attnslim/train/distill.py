"""Distillation ("uptraining") of LISA layers: only q_lr, k_lr and the aligners train (paper §5.1, App. B).

    loss = beta * mean_n Huber_delta(A_n, A_n*) + (1 - beta) * LM loss          (paper Eq. 5-7)

A_n are the student's integrated pre-softmax scores of every trainable SharedAttention layer, A_n* the
teacher's (the original model, a separate no-grad forward on the same batch) recomputed from its attention
spec; the Huber mean runs over the valid causal entries only (gap 9). The LM loss is next-token cross
entropy on packed windows of the packaged text's calibration split, drawn with a seeded generator.
AdamW (0.9, 0.999, wd 0.1), linear warm-up then cosine decay, grad-clip 1.0 (gap 11).
Budget knobs for a CPU: `steps`, `batch_size`, `seq_len`; tokens = steps * batch_size * seq_len.
The default LR is 1e-2, not the paper's 3e-4: the paper trains 40k steps, a CPU budget a few hundred (an
exploratory 12-step probe on SmolLM2, LISA on 15 layers, not kept in benchmarks/results, ended lowest at 1e-2
among 3e-3, 1e-2 and 3e-2).
Memory: the aligner's (b, rows, t, F) activation is chunked over query rows (modules/aligner.Aligner); HF
gradient checkpointing is refused because re-running a layer in backward breaks the score links.
Checkpoints (`checkpoint: PATH`) hold the trainable tensors, the optimizer state, the step and the loss
history (torch.save, loaded with weights_only=True); a run with the same config resumes from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from attnslim.adapters import get_adapter
from attnslim.data import calib_windows, check_source, mixture, token_ids
from attnslim.errors import AttnslimError
from attnslim.linalg.scores import spec_qkv_scores
from attnslim.modules.shared import SharedAttention
from attnslim.settings import check_ints, check_ranges, config_from_mapping
from attnslim.train.schedule import warmup_cosine
from attnslim.train.teacher import teacher_attention


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 1e-2
    weight_decay: float = 0.1
    warmup: float = 0.04  # fraction of steps
    beta: float = 0.25  # weight of the score-distillation term
    delta: float = 1.0  # Huber threshold
    clip: float = 1.0
    source: str = "wiki"
    seed: int = 0
    detach_chain: bool = False  # True: no gradient from layer n into layer n-1's scores
    checkpoint: str | None = None  # file to save to / resume from
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        check_source("train.source", self.source)
        check_ints("train", self, {"steps": 1, "batch_size": 1, "seq_len": 2, "checkpoint_every": 1})
        check_ranges("train", self, {
            "lr": (self.lr > 0, "> 0"), "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "warmup": (0 <= self.warmup < 1, "in [0, 1)"), "beta": (0 <= self.beta <= 1, "in [0, 1]"),
            "delta": (self.delta > 0, "> 0"), "clip": (self.clip > 0, "> 0")})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistillConfig:
        return config_from_mapping(cls, "train", d)

    def resume_key(self) -> dict[str, Any]:
        """The fields a checkpoint must match to be resumed (everything that changes the run)."""
        return {k: v for k, v in asdict(self).items() if k not in ("checkpoint", "checkpoint_every")}


def training_windows(cfg: DistillConfig, tokenizer: Any) -> Any:
    """steps * batch_size windows of seq_len tokens from the source's calibration split (seeded)."""
    need = cfg.batch_size * cfg.seq_len + 1
    available, source = min((int(token_ids(s, "calib", tokenizer).numel()), s) for s in mixture(cfg.source))
    if available < need:
        raise AttnslimError(
            f"training data too short: the {source!r} calibration split has {available} tokens, fewer than "
            f"one batch of {cfg.batch_size}x{cfg.seq_len} (+1); lower train.seq_len / train.batch_size or use a "
            "longer source"
        )
    return calib_windows(cfg.source, tokenizer, cfg.steps * cfg.batch_size, cfg.seq_len, cfg.seed,
                         f"train.steps={cfg.steps} x train.batch_size={cfg.batch_size}")


def trainable_layers(model: Any) -> dict[int, SharedAttention]:
    adapter = get_adapter(model)
    found = {i: adapter.attention(i) for i in range(adapter.num_layers())}
    return {i: m for i, m in found.items() if isinstance(m, SharedAttention) and m.trainable()}


@contextmanager
def student_scores(layers: dict[int, SharedAttention], detach_chain: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Collect each layer's A_n (b, h, l, t) during the student forward; unset the sinks on exit."""
    store: dict[int, torch.Tensor] = {}
    try:
        for m in layers.values():
            m.score_sink, m.detach_donor = store.__setitem__, detach_chain
        yield store
    finally:
        for m in layers.values():
            m.score_sink, m.detach_donor = None, False


@contextmanager
def teacher_scores(teacher: Any, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Collect the teacher's unmasked scores (b, h, l, l) at `layers`, recomputed from each layer's spec.

    The forward run inside the block stops after the deepest layer.
    """
    specs = {i: get_adapter(teacher).attention_spec(i) for i in layers}
    store: dict[int, torch.Tensor] = {}

    def collect(i: int, call: dict[str, Any], _out: torch.Tensor) -> None:
        x = call["hidden_states"]
        store[i] = spec_qkv_scores(specs[i], x, call.get("position_embeddings"))[3].detach()

    with teacher_attention(teacher, layers, collect):
        yield store


def attended_entries(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(l, l) bool: the score entries a layer attends, causal and, for a sliding layer, within `window` tokens
    (HF's rule: query q sees key k when q − window < k ≤ q). Only these enter the KD loss: masked scores never
    reach the output, so fitting them would spend the budget on nothing (notes property 4)."""
    q, k = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    keep = k <= q
    return keep if window is None else keep & (q - k < window)


def distill_loss(
    student: Any, teacher: Any, layers: dict[int, SharedAttention], ids: torch.Tensor, cfg: DistillConfig
) -> tuple[torch.Tensor, float, float]:
    """(loss, kd, lm) for one batch ids (b, l); the loss carries the graph."""
    with torch.no_grad(), teacher_scores(teacher, list(layers)) as target:
        teacher(input_ids=ids, use_cache=False)
    with student_scores(layers, cfg.detach_chain) as got:
        logits = student(input_ids=ids, use_cache=False).logits  # (b, l, vocab)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    adapter, l = get_adapter(teacher), ids.shape[1]
    valid = {i: attended_entries(l, adapter.attention_spec(i).sliding_window, ids.device) for i in layers}
    kd = torch.stack([
        F.huber_loss(got[i][..., valid[i]].float(), target[i][..., valid[i]].float(), delta=cfg.delta)
        for i in layers
    ]).mean()
    loss = cfg.beta * kd + (1 - cfg.beta) * lm
    return loss, float(kd.detach()), float(lm.detach())


def distill(
    student: Any, teacher: Any, tokenizer: Any, cfg: DistillConfig, progress: bool = True
) -> dict[str, Any]:
    """Train the LISA parameters of `student` against `teacher`; returns a JSON-serialisable report."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in student.modules()):
        raise AttnslimError("distill: disable HF gradient checkpointing (it re-runs layers and breaks score links)")
    layers = trainable_layers(student)
    if not layers:
        raise AttnslimError("distill: the model has no trainable SharedAttention layer; convert with method lisa")
    windows = training_windows(cfg, tokenizer)
    device = next(student.parameters()).device
    names = {id(p): n for n, p in student.named_parameters()}
    params = [p for m in layers.values() for p in m.trainable()]
    flags = {n: p.requires_grad for n, p in student.named_parameters()}
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay)
    start, history = _resume(cfg, student, opt, names, params)
    teacher.eval()
    began = time.time()
    try:
        student.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        bar = tqdm(range(start, cfg.steps), desc="distill", disable=not progress, initial=start, total=cfg.steps)
        for step in bar:
            ids = windows.ids[step * cfg.batch_size : (step + 1) * cfg.batch_size].to(device)
            lr = warmup_cosine(cfg.lr, cfg.warmup, cfg.steps, step)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, kd, lm = distill_loss(student, teacher, layers, ids, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            history.append({"step": step, "loss": float(loss.detach()), "kd": kd, "lm": lm, "lr": lr})
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", kd=f"{kd:.3f}", lm=f"{lm:.3f}")
            done = step + 1
            if cfg.checkpoint and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                _save(cfg, done, opt, names, params, history)
    finally:
        for n, p in student.named_parameters():
            p.requires_grad_(flags[n])
    return _report(cfg, layers, params, history, windows.description, time.time() - began, start)


def _report(
    cfg: DistillConfig, layers: dict[int, SharedAttention], params: list[nn.Parameter],
    history: list[dict[str, float]], data: str, seconds: float, resumed_at: int,
) -> dict[str, Any]:
    k = max(1, min(10, len(history) // 5))

    def mean(key: str, part: list[dict[str, float]]) -> float:
        return sum(h[key] for h in part) / max(1, len(part))

    return {
        "trained": True, "layers": sorted(layers), "trainable_params": sum(p.numel() for p in params),
        "steps": cfg.steps, "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "data": data,
        "seconds": round(seconds, 1), "resumed_at": resumed_at, "config": asdict(cfg),
        "first": {key: mean(key, history[:k]) for key in ("loss", "kd", "lm")},
        "last": {key: mean(key, history[-k:]) for key in ("loss", "kd", "lm")},
        "history": [{key: round(v, 5) if isinstance(v, float) else v for key, v in h.items()} for h in history],
    }


def _save(
    cfg: DistillConfig, step: int, opt: torch.optim.Optimizer, names: dict[int, str],
    params: list[nn.Parameter], history: list[dict[str, float]],
) -> None:
    assert cfg.checkpoint is not None
    path = Path(cfg.checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "config": cfg.resume_key(), "optimizer": opt.state_dict(), "history": history,
             "params": {names[id(p)]: p.detach().clone() for p in params}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _resume(
    cfg: DistillConfig, student: Any, opt: torch.optim.Optimizer, names: dict[int, str], params: list[nn.Parameter]
) -> tuple[int, list[dict[str, float]]]:
    if not cfg.checkpoint or not Path(cfg.checkpoint).exists():
        return 0, []
    state = torch.load(cfg.checkpoint, weights_only=True)
    if state["config"] != cfg.resume_key():
        changed = sorted(k for k, v in cfg.resume_key().items() if state["config"].get(k) != v)
        raise AttnslimError(
            f"checkpoint {cfg.checkpoint} was written with a different training config (changed: {changed}); "
            "use the same config to resume or another checkpoint path to start over"
        )
    want = {names[id(p)] for p in params}
    if set(state["params"]) != want:
        raise AttnslimError(f"checkpoint {cfg.checkpoint} holds other parameters than this model's LISA layers")
    with torch.no_grad():
        for p in params:
            p.copy_(state["params"][names[id(p)]])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["history"])
