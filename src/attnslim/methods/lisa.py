"""`lisa` and `ds`: cross-layer attention sharing (LISA, Mu et al., arXiv 2408.01890 v1; seed 002).

What is approximated: the pre-softmax scores A_n = Q_n K_n^T / sqrt(d) of a chosen layer n by those of layer n-1,
aligned over heads by a tiny FFN and corrected by low-rank Q/K of rank r per head:
A_n ~ FFN([A_{n-1}; Q_LR K_LR^T / sqrt(r)]) (modules/shared.py). `ds` (direct sharing) uses A_{n-1} as is.
Layer n keeps its own W_v and W_o; W_q and W_k are dropped (kept only with NF, `nf_min_len`).
Statistics: none (conversion is data-free); the new weights are trained afterwards by distillation
(`train/distill.distill`, teacher = the model before the recipe's first step; run by api.compress through
`Lisa.train_step` after the step, since convert runs per layer without gradients, token ids or a tokenizer).
Cost per LISA layer (h heads, g KV heads, d head dim, D hidden, F aligner width, c = 2h fusion / h add):
  params  + D(h + g) r + c F + F + F h + h   − D(h + g) d (W_q, W_k removed unless NF)
  KV      K_LR g r + V g d elements/token instead of 2 g d (ds: V + a 1-byte position marker)
Decisions where the paper is silent: scores shared before softmax; r = round(d / 6.4) rounded up to even, aligner
width 8h; an untrained layer equals direct sharing; layer presets for depths other than the paper's 32.
Where it lives: methods/lisa.py; modules/shared.py; train/distill.py. The training design and every decision:
docs/methods/lisa.md. Measured: BENCHMARKS.md, section "LISA: cross-layer attention sharing".
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.modules.score_link import ScoreLink
from attnslim.modules.shared import INTEGRATE, DonorAttention, SharedAttention, SharingConfig
from attnslim.plan import JSON, LayerEntry, StepPlan
from attnslim.registry import register_method

# Paper Table 4 (LLaMA2-7B / LLaMA3-8B, 32 layers), converted to 0-based HF indices.
PRESETS_32: dict[int, list[int]] = {
    53: [4, 5, *range(16, 31)],
    66: [3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, *range(21, 30)],
    84: list(range(3, 30)),
}
SELECT = ("given", "preset")
INITS = ("ds", "default")


def default_rank(head_dim: int) -> int:
    """r = d / 6.4 (the paper's 128 -> 20), rounded up to even: 64 -> 10, 128 -> 20."""
    r = max(2, round(head_dim / 6.4))
    return r + (r % 2)


def protected_layers(n_layers: int) -> int:
    """How many leading layers are never shared: max(2, ceil(0.1 L)) (shallow layers are most sensitive)."""
    return max(2, math.ceil(0.1 * n_layers))


def select_layers(
    n_layers: int, fraction: float, cost: dict[int, float] | None = None, protect: int | None = None,
    skip: Collection[int] = (),
) -> list[int]:
    """Greedy layer choice for a sharing budget of `fraction` * n_layers layers.

    Lower cost = share first (e.g. the single-layer DS loss increase of `analysis.sensitivity_report`);
    without costs deeper layers go first. Fractions > 0.75 give one contiguous block after the protected
    layers (the paper's LISA(27)); otherwise a run that touches the first 2/3 of the network holds at most 2
    shared layers (the LISA(21) anchor pattern), a preference: where it leaves the budget unfilled, the cheapest
    remaining layers fill it, so the count asked is the count shared. Never the first `protect` layers, the last
    layer, nor those in `skip` (`unshareable_layers`: a donor of another attention type); a budget larger than
    the layers left is refused with the largest fraction this model can share.
    """
    protect = protected_layers(n_layers) if protect is None else protect
    candidates = [i for i in range(max(1, protect), n_layers - 1) if i not in skip]
    budget = round(fraction * n_layers)
    if not 0 < fraction <= 1 or budget < 1:
        raise AttnslimError(f"fraction={fraction} selects no layer of {n_layers}; use 0 < fraction <= 1")
    if budget > len(candidates):
        why = f"never the first {max(1, protect)} nor the last" + (
            f", nor {sorted(skip)} (their donor has another attention type)" if skip else "")
        raise AttnslimError(f"fraction={fraction:g} asks {budget} of {n_layers} layers to share, but only "
                            f"{len(candidates)} can here ({why}): use a fraction of at most "
                            f"{len(candidates) / n_layers:.2f}, or give the layers")
    if fraction > 0.75:
        return candidates[:budget]
    costs = cost or {i: -float(i) for i in candidates}
    missing = [i for i in candidates if i not in costs]
    if missing:
        raise AttnslimError(f"cost has no entry for candidate layers {missing}; give one per layer")
    chosen: set[int] = set()
    boundary = math.ceil(2 * n_layers / 3)
    order = sorted(candidates, key=lambda j: (costs[j], -j))
    for i in order:
        if len(chosen) == budget:
            break
        run = _run_with(chosen, i)
        if min(run) < boundary and len(run) > 2:
            continue
        chosen.add(i)
    chosen.update([i for i in order if i not in chosen][: budget - len(chosen)])  # the anchor rule left too few
    return sorted(chosen)


def _run_with(chosen: set[int], i: int) -> list[int]:
    lo, hi = i, i
    while lo - 1 in chosen:
        lo -= 1
    while hi + 1 in chosen:
        hi += 1
    return list(range(lo, hi + 1))


def preset_layers(n_layers: int, percent: int, skip: Collection[int] = ()) -> list[int]:
    """The paper's LISA(17/21/27) lists for 32 layers (percent 53/66/84), else `select_layers`; never `skip`."""
    if percent not in PRESETS_32:
        raise AttnslimError(f"percent={percent} has no preset; valid: {sorted(PRESETS_32)}")
    if n_layers == 32:
        return [i for i in PRESETS_32[percent] if i not in skip]
    return select_layers(n_layers, percent / 100, skip=skip)


def unshareable_layers(adapter: Adapter) -> set[int]:
    """Layers whose donor (the layer before) has another attention type, which `check_pair` refuses: on Gemma-3
    each global layer and the sliding layer after it."""
    types = adapter.layer_types()
    return {i for i in range(1, len(types)) if types[i] != types[i - 1]}


# --- installing receivers and donors ------------------------------------------------------------
def _is_ours(module: nn.Module) -> bool:
    return isinstance(module, DonorAttention | SharedAttention)


def _is_foreign(module: nn.Module) -> bool:
    """An unchanged model attention (not one of attnslim's replacement modules)."""
    return not type(module).__module__.startswith("attnslim.")


def check_pair(adapter: Adapter, layer: int) -> None:
    """Raise unless layer `layer` can read scores from layer - 1 (exists, is attention, same heads/type)."""
    if layer < 1:
        raise AttnslimError(f"layer {layer} has no donor (layer {layer - 1}); share only layers >= 1")
    donor = adapter.attention(layer - 1)
    if not (_is_ours(donor) or _is_foreign(donor)):
        raise AttnslimError(
            f"layer {layer}: its donor, layer {layer - 1}, is a {type(donor).__name__}, which computes no attention "
            f"scores; choose layers whose previous layer is attention, or apply this step before the other one"
        )
    receiver = adapter.attention(layer)
    if not (_is_ours(receiver) or _is_foreign(receiver)):
        raise AttnslimError(
            f"layer {layer}: its attention is already a {type(receiver).__name__}; sharing needs a standard "
            "attention layer (give each step disjoint layers)"
        )
    heads = [m.shape.n_heads if isinstance(m, SharedAttention) else _spec(adapter, i).n_heads
             for i, m in ((layer - 1, donor), (layer, receiver))]
    if heads[0] != heads[1]:
        raise AttnslimError(
            f"layer {layer}: donor layer {layer - 1} has {heads[0]} query heads, the receiver {heads[1]}; "
            "scores can only be shared between layers with the same number of heads"
        )
    types = adapter.layer_types()
    if types[layer - 1] != types[layer]:
        raise AttnslimError(
            f"layer {layer} ({types[layer]}) cannot read scores of layer {layer - 1} ({types[layer - 1]}): their "
            "attention spans differ; choose layers whose donor has the same attention type"
        )


def _spec(adapter: Adapter, layer: int) -> Any:
    try:
        return adapter.attention_spec(layer)
    except (AttributeError, AttnslimError) as err:
        raise AttnslimError(f"layer {layer}: cannot read its attention weights ({err})") from err


def install_receiver(adapter: Adapter, layer: int, module: SharedAttention) -> None:
    """Install `module` at `layer`, wiring a new ScoreLink from layer - 1 (made a DonorAttention if needed).

    Keeps the outgoing link if `layer` already exported scores to layer + 1 (any conversion order works).
    """
    donor: Any = adapter.attention(layer - 1)  # a DonorAttention or SharedAttention below
    if not _is_ours(donor):
        donor = DonorAttention(_spec(adapter, layer - 1))
        adapter.replace_attention(layer - 1, donor)
    old = adapter.attention(layer)
    link = ScoreLink(layer - 1, layer)
    donor.export, module.link = link, link
    module.export = getattr(old, "export", None)
    adapter.replace_attention(layer, module)


@contextmanager
def temporary_sharing(adapter: Adapter, receivers: dict[int, SharingConfig]) -> Iterator[None]:
    """Install receivers (analysis sweeps: DS / AVG) and restore the original modules and links on exit."""
    touched = sorted({j for i in receivers for j in (i - 1, i) if j >= 0})
    originals = {j: adapter.attention(j) for j in touched}
    links = {j: (getattr(m, "link", None), getattr(m, "export", None)) for j, m in originals.items()}
    try:
        for i in sorted(receivers):
            module = SharedAttention(_spec(adapter, i), receivers[i])
            if receivers[i].uniform:
                adapter.replace_attention(i, module)
                continue
            check_pair(adapter, i)
            install_receiver(adapter, i, module)
        yield
    finally:
        for j, original in originals.items():
            adapter.replace_attention(j, original)
            if isinstance(original, SharedAttention):
                original.link = links[j][0]
            if isinstance(original, SharedAttention | DonorAttention):
                original.export = links[j][1]


# --- the methods ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharingEntry(LayerEntry):
    """A receiver layer: the layer it reuses the scores of, and how it builds them. JSON: {"donor", **sharing}."""

    donor: int
    sharing: SharingConfig

    def to_json(self) -> dict[str, JSON]:
        return {"donor": self.donor, **self.sharing.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, JSON], where: str) -> SharingEntry:
        donor, rest = data.get("donor"), {k: v for k, v in data.items() if k != "donor"}
        try:
            assert isinstance(donor, int)
            return cls(donor, SharingConfig(**rest))  # type: ignore[arg-type]
        except (AssertionError, TypeError, AttnslimError) as err:
            raise AttnslimError(f"{where}: the plan entry {dict(data)} is not a LISA receiver ({err}); re-create "
                                "the output with attnslim compress") from err


@dataclass(frozen=True)
class _Sharing(Method[SharingEntry, None]):
    """Shared plan/convert/skeleton of `ds` and `lisa`; subclasses say how a receiver builds its scores."""

    entry_type = SharingEntry

    select: str = "given"  # given: the step's layers; preset: paper list / select_layers within them
    percent: int = 53
    nf_min_len: int | None = None
    sequential = False

    def rewires(self, layer: int) -> list[int]:
        """Converting receiver n makes its donor, layer n-1, export its scores (a DonorAttention, or a link on a
        receiver below): with --offload the pipeline holds layer n-1 in memory too and writes it back."""
        return [layer - 1]

    def __post_init__(self) -> None:
        require(self.select in SELECT, self.name, "select", self.select, " | ".join(SELECT))
        require(self.percent in PRESETS_32, self.name, "percent", self.percent, f"{sorted(PRESETS_32)}")
        require(self.nf_min_len is None or (isinstance(self.nf_min_len, int) and self.nf_min_len >= 1),
                self.name, "nf_min_len", self.nf_min_len, "null (no NF) or an int >= 1 (paper: 2049)")

    def sharing(self, head_dim: int, n_heads: int) -> SharingConfig:
        raise NotImplementedError

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, None],
             context: StepContext = NO_CONTEXT) -> StepPlan[SharingEntry]:
        chosen = layers
        if self.select == "preset":
            skip = unshareable_layers(adapter)
            chosen = [i for i in preset_layers(adapter.num_layers(), self.percent, skip) if i in set(layers)]
        if not chosen:
            raise AttnslimError(f"method {self.name!r}: no layer left to share among candidates {layers}")
        for i in chosen:
            check_pair(adapter, i)
        entries: dict[int, SharingEntry] = {}
        for i in chosen:
            spec = _spec(adapter, i)
            cfg = self.sharing(spec.head_dim, spec.n_heads)
            entries[i] = SharingEntry(i - 1, cfg)
        return StepPlan(entries, info={"chains": [list(c) for c in _chains(chosen)]})

    def _build(self, adapter: Adapter, layer: int, entry: SharingEntry) -> SharedAttention:
        module = SharedAttention(_spec(adapter, layer), entry.sharing)
        install_receiver(adapter, layer, module)
        return module

    def convert(self, adapter: Adapter, layer: int, entry: SharingEntry, stats: None) -> Fit:
        self._build(adapter, layer, entry).init_weights("ds")
        return None

    def skeleton(self, adapter: Adapter, layer: int, entry: SharingEntry) -> None:
        self._build(adapter, layer, entry)


def _chains(layers: list[int]) -> list[list[int]]:
    """Runs of consecutive receivers, each with its standard donor first: [[3, 4, 5], [7, 8]]."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i - 1, i])
    return out


@register_method("ds")
@dataclass(frozen=True)
class Ds(_Sharing):
    """Direct sharing: layer n softmaxes layer n-1's scores unchanged (no new parameters)."""

    def sharing(self, head_dim: int, n_heads: int) -> SharingConfig:
        return SharingConfig(nf_min_len=self.nf_min_len)


@register_method("lisa")
@dataclass(frozen=True)
class Lisa(_Sharing):
    rank: int | None = None  # per-head rank of the compensator; None: default_rank(head_dim)
    align_hidden: int | None = None  # aligner width; None: 8 * heads; 0: single linear (LISA_SL)
    align: bool = True  # False: no aligner ("+Diff." ablation)
    compensate: bool = True  # False: no low-rank Q/K ("+Align" ablation)
    integrate: str = "fusion"
    rope_lr: bool = False
    init: str = "ds"
    seed: int = 0  # of the new weights' init
    train: dict[str, Any] | None = None  # DistillConfig fields; run by Lisa.distill after conversion

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.rank is None or (isinstance(self.rank, int) and self.rank >= 1), self.name, "rank", self.rank,
                "null (d/6.4, even) or an int in 1..head_dim-1")
        require(self.align_hidden is None or (isinstance(self.align_hidden, int) and self.align_hidden >= 0),
                self.name, "align_hidden", self.align_hidden, "null (8 x heads), 0 (single linear) or an int > 0")
        require(self.align or self.compensate, self.name, "align/compensate", (self.align, self.compensate),
                "at least one true (both false is direct sharing: use method ds)")
        require(self.integrate in INTEGRATE, self.name, "integrate", self.integrate, " | ".join(INTEGRATE))
        require(self.init in INITS, self.name, "init", self.init, " | ".join(INITS))
        if self.train is not None:
            from attnslim.train.distill import DistillConfig

            require(isinstance(self.train, dict), self.name, "train", self.train, "a mapping of DistillConfig fields")
            DistillConfig.from_dict(self.train)

    def sharing(self, head_dim: int, n_heads: int) -> SharingConfig:
        rank = (self.rank or default_rank(head_dim)) if self.compensate else 0
        if self.compensate and not 1 <= rank < head_dim:
            raise AttnslimError(f"method 'lisa': rank={rank} is invalid for head_dim {head_dim}; "
                                f"valid: 1..{head_dim - 1}")
        hidden = None if not self.align else (8 * n_heads if self.align_hidden is None else self.align_hidden)
        return SharingConfig(rank=rank, align_hidden=hidden, integrate=self.integrate, rope_lr=self.rope_lr,
                             nf_min_len=self.nf_min_len)

    def convert(self, adapter: Adapter, layer: int, entry: SharingEntry, stats: None) -> Fit:
        self._build(adapter, layer, entry).init_weights(self.init, self.seed)
        return None

    @property
    def trains(self) -> bool:
        return self.train is not None

    def train_step(self, model: Any, tokenizer: Any, teacher: Any, progress: bool = True) -> dict[str, Any]:
        """Distil the new parameters (aligners, compensators) with the recipe's `train` budget."""
        if self.train is None:
            raise AttnslimError("method 'lisa': train_step needs a `train` budget; set args.train or skip training")
        from attnslim.train.distill import DistillConfig, distill

        return distill(model, teacher, tokenizer, DistillConfig.from_dict(self.train), progress=progress)
