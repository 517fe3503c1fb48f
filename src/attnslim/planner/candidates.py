"""What the planner may do to one layer: a `Candidate` is one recipe step's method and arguments applied to that
layer alone (keep, `mla` at one KV width, `nbl`, `drop`, `ds`).

A plan is then an ordinary recipe: the layers that chose the same candidate form one step (recipe.Step with a
list of layers), so every candidate must be expressible as a step whose arguments do not depend on the layer.
`mla` takes one rank (or kv_ratio) per step, not per layer, so each KV width of the ladder is its own step. The
ladder is given as kept fractions of the dense cache (`kv_ratio`): the method turns a fraction into each layer's
rank + rope dims itself (methods/mla_base.py), so a layer's width is exactly what compress will build.

Engines (`--engine`): `hf` serves every candidate. `vllm` serves what stock vLLM's MLA kernels and attnslim's vLLM
plugin serve: MLA only in DeepSeek-V3's layout (layout: deepseek) with kv_lora_rank + qk_rope_head_dim of 320 or
576 at a 64-dim rotary key (attnslim.mla_widths: kv_lora_rank 256 or 512), nbl and drop (the
plugin's layers without KV), and keep; sharing is not served there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from attnslim.errors import AttnslimError
from attnslim.mla_widths import VLLM_LORA_RANKS, VLLM_ROPE

KINDS = ("keep", "mla", "nbl", "drop", "ds")
DEFAULT_KINDS = ("keep", "mla", "nbl", "drop", "ds")
DEFAULT_LADDER = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)  # mla's kv_ratio per width (kept fraction per layer)
ENGINES = ("hf", "vllm")
SHARING = ("ds",)  # kinds that read layer i-1's scores: layer i-1 must be kept or share too
DEFAULT_MLA_ARGS: dict[str, Any] = {"refit_o": True}  # one-shot: o_proj refitted (recipes/mla-oneshot.yaml)
DEFAULT_NBL_ARGS: dict[str, Any] = {"sequential": True}  # fitted on the upstream layers as converted


@dataclass(frozen=True, eq=False)
class Candidate:
    """One choice for a layer: `method` (None: keep the layer as it is) with step arguments `args`."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # unique within a candidate set: what reports and plans name it by

    @property
    def method(self) -> str | None:
        return None if self.kind == "keep" else self.kind

    def step_args(self) -> dict[str, Any]:
        """The arguments of the recipe step holding every layer that chose this candidate."""
        return dict(self.args)

    def __hash__(self) -> int:
        return hash(self.label)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Candidate) and other.label == self.label


def _check_ladder(ladder: Sequence[float]) -> tuple[float, ...]:
    bad = [f for f in ladder if not isinstance(f, int | float) or isinstance(f, bool) or not 0 < f < 1]
    if bad or not ladder:
        raise AttnslimError(f"the MLA ladder {list(ladder)} must be kept fractions of the dense KV cache in (0, 1), "
                            "e.g. 0.25,0.5,0.75")
    return tuple(sorted({float(f) for f in ladder}))


def candidate_set(kinds: Sequence[str] = DEFAULT_KINDS, ladder: Sequence[float] = DEFAULT_LADDER,
                  engine: str = "hf", mla_args: dict[str, Any] | None = None,
                  nbl_args: dict[str, Any] | None = None, rotary_dims: int | None = None) -> list[Candidate]:
    """The candidates offered to every layer (a layer that cannot take one drops it: `layer_candidates`).

    `mla_args`/`nbl_args` are added to each mla/nbl step (default: refit_o for mla, sequential fits for nbl).
    `rotary_dims`: one head's rotary dims; under `--engine vllm` a head rotating more than DeepSeek's 64-dim key
    (Llama-3, Qwen2.5: 128) keeps its rotary pairs at the 32 fastest frequencies (`rope_fastest`), the only form
    whose export has a served width (docs/serving.md)."""
    if engine not in ENGINES:
        raise AttnslimError(f"engine {engine!r} is unknown; valid: {', '.join(ENGINES)}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise AttnslimError(f"candidates {list(kinds)}: unknown {unknown}; valid: {', '.join(KINDS)}")
    mla = dict(DEFAULT_MLA_ARGS if mla_args is None else mla_args)
    nbl = dict(DEFAULT_NBL_ARGS if nbl_args is None else nbl_args)
    for where, args, owned in (("mla", mla, ("kv_ratio", "rank", "rope_dims", "layout", "alloc")),
                               ("nbl", nbl, ("m", "fraction", "criterion"))):
        if clash := sorted(set(args) & set(owned)):
            raise AttnslimError(f"{where} arguments {clash} are set by the planner per candidate; leave them out")
    out: list[Candidate] = []
    for kind in dict.fromkeys(kinds):
        if kind == "keep":
            out.append(Candidate("keep", {}, "keep"))
        elif kind == "mla" and engine == "hf":
            out += [Candidate("mla", {"kv_ratio": f, **mla}, f"mla@{f:g}") for f in _check_ladder(ladder)]
        elif kind == "mla":
            fastest = {"rope_fastest": VLLM_ROPE // 2} if rotary_dims is not None and rotary_dims > VLLM_ROPE else {}
            # biases: fold: vLLM's DeepSeek model has no attention bias, so a Qwen-family model's are folded into the
            # weights (methods/mla_base.py; a no-op without biases)
            out += [Candidate("mla", {"rank": r, "rope_dims": VLLM_ROPE, "layout": "deepseek", "biases": "fold",
                                      **fastest, **mla},
                              f"mla@{r}+{VLLM_ROPE}") for r in VLLM_LORA_RANKS]
        elif kind == "nbl":
            out.append(Candidate("nbl", {"criterion": "given", **nbl}, "nbl"))
        elif kind == "drop":
            out.append(Candidate("drop", {"select": "given"}, "drop"))
        elif kind == "ds" and engine == "hf":
            out.append(Candidate("ds", {"select": "given"}, "ds"))
    return out
