"""LoRA recovery fine-tuning for ATP (seed 004 §5.2, App. C): rank 32 on q/k/v via peft.

Loss: the paper's layer is not causal, so a teacher-forced next-token loss over a sequence would
see the targets. Each example is a prompt-only window of `context` tokens from the training split of the
text source, and `loss` picks the objective:
  "last_token"  cross-entropy of the *next* token at the last position over the full vocabulary — the same
                last-position protocol the evaluation uses (eval/choice.py), with no target inside the input;
                one target per sequence (the paper's task loss, adapted to a prompt-only window)
  "last_kd"     distillation at the last position: KL(teacher ‖ model) of the next-token distributions of the
                original model (`teacher`) and the model at the prompt's last position — leak-free like
                "last_token", but a full distribution per sequence instead of one token (not in the paper)
  "kd"          distillation at every position: KL(teacher ‖ model) averaged over all prompt positions. The
                teacher's distribution at t depends on tokens ≤ t only, so its minimiser is the teacher itself
                whatever the non-causal layer sees after t — leak-free with b·t targets per batch (not in the
                paper). The best all-layer recovery measured; its accuracy plateaus with steps at this batch,
                and neither LoRA on every linear nor larger batches move the plateau: on a CPU budget optimizer
                steps matter more than batch size
  "hidden"      hidden-state distillation: every decoder layer's output, on the model's own converted upstream,
                pulled towards the original model's at every position (relative squared error per position) —
                unlike "layer", it trains against the errors that compound through the converted layers; leak-
                free like "kd" (not in the paper)
  "layer"       layer-local distillation against the original model (train/layer_match.py): every replaced
                attention layer matches the dense layer's output at every position, on the dense input — not
                in the paper; b·t·d targets per layer per batch instead of b. Faster to recover than
                "last_token" at equal steps
  "choice"      the paper's task fine-tuning (§5.2: "we first finetune the model on the datasets", then
                validate): multiple-choice next-word items (eval/choice.py) built from the *calibration* split,
                one item per sequence, each used once; cross-entropy over the candidates' logits at the last
                position (the paper's "probability on the four tokens A, B, C, D"). The evaluation items come
                from the evaluation split, so no item or text is shared. It teaches the task, not the language
                model: use it after a distillation recovery, and compare with the dense model given the same
                fine-tuning. After a "kd" recovery it gave no gain: one labelled position per 256-token
                sequence is too little signal here.
Every loss above is measured against the others in BENCHMARKS.md, section ATP (benchmarks/atp.py).
Hyperparameters follow App. C where stated (rank 32 on q/k/v only, lr 2e-4, weight decay 1e-2, 400 iterations
for Llama-2) and our choice where not (alpha = 2·rank, dropout 0.05, AdamW, 20-step warm-up then cosine,
gradient clipping 1.0). Batches are drawn from a generator seeded with (seed, step), so a resumed run sees the
same batches as an uninterrupted one.

Checkpoints (every `save_every` steps and at the end) go to `out_dir`: `adapter-<step>.safetensors` (LoRA
weights), `optimizer-<step>.pt` (optimizer, scheduler and RNG states; read back with
torch.load(weights_only=True)) and `state.json` (step, losses, recipe, and the names of those two files),
replaced atomically after them, so a run killed while saving resumes from the last complete checkpoint.
`recover_with_lora` resumes from them when present.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from attnslim.adapters import get_adapter
from attnslim.data import sequence_start, sequences_ending_at, token_ids
from attnslim.errors import AttnslimError
from attnslim.eval.choice import ChoiceItems, choice_items, last_position_logits
from attnslim.train.heal import hidden_distance
from attnslim.train.layer_match import layer_match_loss

LOSSES = ("last_token", "last_kd", "kd", "hidden", "layer", "choice")
SCOPES = ("all", "converted")
LEGACY_FILES = {"adapter": "adapter.safetensors", "optimizer": "optimizer.pt"}


@dataclass(frozen=True)
class LoraRecipe:
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    steps: int = 300
    batch_size: int = 4
    context: int = 256
    lr: float = 2e-4
    weight_decay: float = 1e-2
    warmup: int = 20
    source: str = "wiki"
    seed: int = 0
    save_every: int = 25
    loss: str = "last_token"  # last_token | last_kd | kd | hidden | layer | choice (kd.. layer need the teacher)
    scope: str = "all"  # all: `targets` of every decoder layer (the measured setting) | converted: only the layers
    #                     the method converted (callers pass them as `converted`)

    def __post_init__(self) -> None:
        for key in ("rank", "alpha", "steps", "batch_size", "context", "save_every"):
            if getattr(self, key) < 1:
                raise AttnslimError(f"LoRA recipe: {key}={getattr(self, key)} must be ≥ 1")
        if self.scope not in SCOPES:
            raise AttnslimError(f"LoRA recipe: scope={self.scope!r}; valid: {' | '.join(SCOPES)}")
        if self.loss not in LOSSES:
            raise AttnslimError(f"LoRA recipe: loss={self.loss!r}; valid: {' | '.join(LOSSES)}")
        if not 0.0 <= self.dropout < 1.0 or self.lr <= 0 or self.warmup < 0:
            raise AttnslimError(f"LoRA recipe: dropout={self.dropout} (need [0, 1)), lr={self.lr} (> 0), "
                                f"warmup={self.warmup} (≥ 0)")


def batch_at(ids: torch.Tensor, recipe: LoraRecipe, step: int, start: int | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (batch, context) and their next tokens (batch,) for one step; deterministic in (seed, step). Each
    prompt is a sequence: `start` (the tokenizer's BOS, data.sequence_start) first where given."""
    gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
    ends = torch.randint(0, ids.numel() - recipe.context - 1, (recipe.batch_size,), generator=gen) + recipe.context
    return sequences_ending_at(ids, ends.tolist(), recipe.context, start), ids[ends]


def choice_loss(model: Any, items: ChoiceItems, rows: slice) -> torch.Tensor:
    """Cross-entropy over the candidates' next-token logits at the last prompt position, for items[rows]."""
    logits = last_position_logits(model, items, rows)  # (b, vocab)
    scores = logits.gather(-1, items.choices[rows].to(logits.device))  # (b, n_choices)
    return F.cross_entropy(scores, items.labels[rows].to(logits.device))


def last_token_loss(model: Any, prompts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next token at the last prompt position (the answer is never in the input)."""
    logits = model(input_ids=prompts, use_cache=False).logits[:, -1].float()  # (b, vocab)
    return F.cross_entropy(logits, targets)


def kd_loss(model: Any, teacher: Any, prompts: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """KL(teacher ‖ model) of the next-token distributions, mean over the positions (only the last prompt
    position when `last_only`). The teacher's distribution at t is a function of tokens ≤ t alone, so the
    loss is minimised by matching it, whatever a non-causal model can see after t: no future-token leak."""
    pick = slice(-1, None) if last_only else slice(None)
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=prompts, use_cache=False).logits[:, pick].float(), dim=-1)
    got = F.log_softmax(model(input_ids=prompts, use_cache=False).logits[:, pick].float(), dim=-1)  # (b, t, vocab)
    return F.kl_div(got.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")


def hidden_loss(model: Any, teacher: Any, prompts: torch.Tensor) -> torch.Tensor:
    """Mean over layers and positions of ‖h_S − h_T‖² / ‖h_T‖² for every decoder layer's output hidden state,
    the model running on its own (converted) upstream. Per position, so massive-activation tokens do not
    dominate; leak-free for the same reason as `kd_loss` (h_T at t depends on tokens ≤ t only)."""
    with torch.no_grad():
        target = teacher(input_ids=prompts, use_cache=False, output_hidden_states=True).hidden_states[1:]
    return hidden_distance(model(input_ids=prompts, use_cache=False, output_hidden_states=True).hidden_states[1:],
                           target)


def last_kd_loss(model: Any, teacher: Any, prompts: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ model) of the next-token distributions at the last prompt position (batch mean)."""
    return kd_loss(model, teacher, prompts, last_only=True)


def replaced_layers(model: Any, teacher: Any) -> list[int]:
    """Layers whose attention module is not the teacher's type (what loss="layer" trains); none is an error."""
    student, dense = get_adapter(model), get_adapter(teacher)
    if student.num_layers() != dense.num_layers():
        raise AttnslimError(f"teacher has {dense.num_layers()} layers, the model {student.num_layers()}; "
                            "pass the model the compressed one was made from")
    layers = [i for i in range(student.num_layers())
              if type(student.attention(i)) is not type(dense.attention(i))]
    if not layers:
        raise AttnslimError("loss='layer': no attention layer of the model differs from the teacher's; "
                            "convert layers first (e.g. method atp)")
    return layers


def lora_targets(model: Any, names: tuple[str, ...], layers: list[int] | None) -> list[str]:
    """Full module names of the linears called `names` (suffixes, e.g. "q_proj", "gate_proj") in decoder layers
    `layers` (None: all). Anything peft cannot wrap plainly is refused: a module that is not an nn.Linear (e.g.
    a factored LowRankLinear of another method) or one shared between layers (LoRA would be merged twice)."""
    adapter = get_adapter(model)
    where = {id(m): n for n, m in model.named_modules()}
    blocks = adapter.decoder_layers()
    out: list[str] = []
    owner: dict[int, int] = {}  # id(module) -> layer
    for i in range(len(blocks)) if layers is None else layers:
        for name in names:
            hits = [(n, m) for n, m in blocks[i].named_modules() if n == name or n.endswith("." + name)]
            if not hits:
                raise AttnslimError(f"LoRA recovery: decoder layer {i} has no module named {name!r}; targets are "
                                    "linear layer names such as q_proj, k_proj, v_proj, o_proj, gate_proj")
            for n, m in hits:
                if not isinstance(m, nn.Linear):
                    raise AttnslimError(
                        f"LoRA recovery: layer {i}'s {n} is a {type(m).__name__}, not a plain linear, so LoRA cannot "
                        "train it; use recover scope 'converted' (only the layers this method converted) or other "
                        "targets")
                if id(m) in owner:
                    raise AttnslimError(f"LoRA recovery: layer {i}'s {n} is shared with layer {owner[id(m)]}; use "
                                        "recover scope 'converted' or leave that projection out of the targets")
                owner[id(m)] = i
                out.append(f"{where[id(blocks[i])]}.{n}")
    return out


def _lr_factor(recipe: LoraRecipe, step: int) -> float:
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def recover_with_lora(
    model: Any, tokenizer: Any, recipe: LoraRecipe, out_dir: str | Path, progress: bool = True, merge: bool = True,
    stop_after: int | None = None, teacher: Any = None, converted: list[int] | None = None,
    items: ChoiceItems | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Fine-tune LoRA adapters on `recipe.targets` of `model` (resuming from `out_dir`); returns (model, log).

    With merge=True the adapters are merged into the q/k/v weights of `model` itself (in place) and it is
    returned, so it saves and loads like any compressed model. `stop_after` runs at most that many steps in this
    call (a time box); the checkpoint written on stopping lets the next call continue exactly where this one
    stopped.
    `teacher` (the original model) is required by the distillation losses. `converted`: the layers the caller's
    method converted; recipe.scope "converted" puts adapters on their `recipe.targets` only ("all": every layer).
    loss="layer" trains against the layers whose attention module differs in type from the teacher's.
    `items`: loss "choice"'s training items, used in order, `recipe.batch_size` per step (e.g. eval/boolq.py's
    BoolQ prompts); default: next-word items from `recipe.source`'s calibration split.
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    if recipe.loss not in ("last_token", "choice") and teacher is None:
        raise AttnslimError(f"LoRA recipe loss={recipe.loss!r} needs the original model: "
                            "pass teacher=<the dense model>")
    if recipe.scope == "converted" and converted is None:
        raise AttnslimError("LoRA recipe scope 'converted': pass the converted layers as `converted`")
    matched = replaced_layers(model, teacher) if recipe.loss == "layer" else []
    modules = lora_targets(model, recipe.targets, converted if recipe.scope == "converted" else None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)  # LoRA A initialisation
    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=recipe.dropout,
                        target_modules=modules, bias="none")
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(recipe, s))
    state: dict[str, Any] = {"step": 0, "losses": [], "seconds": 0.0, "recipe": asdict(recipe)}
    if (out / "state.json").exists():
        state = json.loads((out / "state.json").read_text())
        defaults = json.loads(json.dumps(asdict(LoraRecipe())))  # fields added since the checkpoint: defaults
        if {**defaults, **state["recipe"]} != json.loads(json.dumps(asdict(recipe))):
            raise AttnslimError(f"{out} holds a checkpoint of a different LoRA recipe; use another out_dir")
        files = state.get("files", LEGACY_FILES)  # checkpoints written before per-step file names
        set_peft_model_state_dict(peft_model, load_file(str(out / files["adapter"])))
        saved = torch.load(out / files["optimizer"], weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])  # LoRA dropout continues as if never interrupted
        if saved.get("cuda_rng") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])

    def checkpoint() -> None:
        """New adapter/optimizer files under per-step names, then state.json (atomically) points to them, then
        the old files go: a run killed at any moment resumes from a consistent step."""
        old = state.get("files")
        step = state["step"]
        files = {"adapter": f"adapter-{step:06d}.safetensors", "optimizer": f"optimizer-{step:06d}.pt"}
        weights = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
        save_file(weights, str(out / files["adapter"]))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   out / files["optimizer"])
        state["files"] = files
        tmp = out / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(out / "state.json")
        for name in (old or LEGACY_FILES).values():
            if name not in files.values():
                (out / name).unlink(missing_ok=True)

    ids, bos = token_ids(recipe.source, "calib", tokenizer), sequence_start(tokenizer)
    if ids.numel() < recipe.context + 2:
        raise AttnslimError(f"the {recipe.source!r} training split is shorter than context={recipe.context}")
    wanted = recipe.steps * recipe.batch_size
    if items is not None and (recipe.loss != "choice" or items.contexts.shape[0] < wanted):
        raise AttnslimError(f"LoRA recovery: training items need loss 'choice' and ≥ steps × batch = {wanted} rows; "
                            f"got loss {recipe.loss!r} and {items.contexts.shape[0]} rows")
    if items is None and recipe.loss == "choice":
        items = choice_items(recipe.source, tokenizer, split="calib", n=wanted, context=recipe.context,
                             seed=recipe.seed)
    device = next(peft_model.parameters()).device
    peft_model.train()
    end = recipe.steps if stop_after is None else min(recipe.steps, state["step"] + stop_after)
    bar = tqdm(range(state["step"], end), desc="lora", disable=not progress, initial=state["step"],
               total=recipe.steps)
    start = time.time()
    for step in bar:
        prompts, targets = batch_at(ids, recipe, step, bos)
        if recipe.loss == "layer":
            loss = layer_match_loss(peft_model.get_base_model(), teacher, matched, prompts.to(device))
        elif recipe.loss == "hidden":
            loss = hidden_loss(peft_model, teacher, prompts.to(device))
        elif items is not None:
            loss = choice_loss(peft_model, items, slice(step * recipe.batch_size, (step + 1) * recipe.batch_size))
        elif recipe.loss in ("last_kd", "kd"):
            loss = kd_loss(peft_model, teacher, prompts.to(device), last_only=recipe.loss == "last_kd")
        else:
            loss = last_token_loss(peft_model, prompts.to(device), targets.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        state["losses"].append(round(value, 5))
        state["step"] = step + 1
        bar.set_postfix(loss=f"{value:.3f}")
        if state["step"] % recipe.save_every == 0 or state["step"] == end:
            state["seconds"] += time.time() - start
            start = time.time()
            checkpoint()
    peft_model.eval()
    log = {k: state[k] for k in ("step", "losses", "seconds", "recipe")}
    if not merge:
        return peft_model, log
    merged = peft_model.merge_and_unload()
    if merged is not model:  # callers (compress, progressive stages) keep using `model`; peft merges in place
        raise AttnslimError("LoRA recovery: peft returned a new model from merge_and_unload; this peft version is "
                            "unsupported (pin the version in pyproject.toml)")
    return merged, log
