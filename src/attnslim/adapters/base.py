"""The adapter contract: everything a method may know about a model's architecture.

Methods read `AttentionSpec` / `MLPSpec` and call `replace_attention` / `replace_linear`; they never
import `transformers.models.*`. One adapter per family, registered by `config.model_type`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from attnslim.errors import AttnslimError

ATTENTION_LINEARS = ("q", "k", "v", "o")
MLP_LINEARS = ("gate", "up", "down")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of one layer (None in the spec means learned/absolute positions)."""

    theta: float  # the config's base; a rotation is rebuilt from the model's own table (adapters/rotary.py), never
    # from theta: scaled RoPE (llama3, yarn) changes the frequencies
    rotary_dims: int  # number of head dims rotated (== head_dim for full RoPE)
    layer_type: str = "full_attention"  # key into the model's per-layer-type rotary tables (Gemma3)


@dataclass(frozen=True)
class RMSNormSpec:
    """A per-head RMS norm as a formula: y = gain ⊙ x / sqrt(mean(x²) + eps) over the last dim (head_dim)."""

    gain: torch.Tensor  # (head_dim,) the effective gain (Gemma3: 1 + weight)
    eps: float


@dataclass(frozen=True)
class QKNorm:
    """How a family normalises each head's query and key: data, not code. The attention module holds two per-head
    RMS norms (children `q`, `k`) computing y = (gain_offset + weight) ⊙ x / sqrt(mean(x²) + eps) over head_dim,
    after the projections and before RoPE; `eps_attr` names the module attribute holding eps.
    Gemma3: gain_offset 1 (a (1 + w) gain), eps_attr "eps"; Qwen3: gain_offset 0, eps_attr "variance_epsilon"."""

    gain_offset: float
    eps_attr: str
    q: str = "q_norm"
    k: str = "k_norm"

    def rms(self, norm: nn.Module) -> RMSNormSpec:
        """`norm` as a formula (gain in float32)."""
        weight: Any = norm.weight
        return RMSNormSpec(gain=self.gain_offset + weight.detach().float(), eps=float(getattr(norm, self.eps_attr)))


@dataclass(frozen=True)
class AttentionHeads:
    """Head counts and width of one attention layer, from the config alone: what inspect and the FLOP count need,
    readable whatever modules replaced the layer's linears (a factored q has no dense weight to read a spec from)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass
class AttentionSpec:
    """One attention sub-block in canonical form. Weights are `[out, in]` like `nn.Linear.weight`.

    Shapes: q (n_heads*head_dim, hidden), k/v (n_kv_heads*head_dim, hidden), o (hidden, n_heads*head_dim).
    `q_norm`/`k_norm` (QK-norm: Gemma3, Qwen3) act per head on (..., head_dim) before RoPE.
    """

    layer: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    scaling: float  # multiplies q·k before softmax
    rope: RopeSpec | None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    k_norm_rms: RMSNormSpec | None = None  # k_norm as a formula, where the adapter knows it is a per-head RMS norm
    q_norm_rms: RMSNormSpec | None = None  # q_norm likewise
    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    def weight(self, name: str) -> torch.Tensor:
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}[name]

    def bias(self, name: str) -> torch.Tensor | None:
        return {"q": self.q_bias, "k": self.k_bias, "v": self.v_bias, "o": self.o_bias}[name]

    def to(self, device: torch.device) -> AttentionSpec:
        """The same spec with its weights, biases and norm gains on `device`: a fit computes where its statistics
        live (CPU), whatever device the model's layer is on. The norm modules stay where they are."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        def move_norm(n: RMSNormSpec | None) -> RMSNormSpec | None:
            return None if n is None else RMSNormSpec(n.gain.to(device), n.eps)

        return replace(self, q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), o=self.o.to(device),
                       q_bias=move(self.q_bias), k_bias=move(self.k_bias), v_bias=move(self.v_bias),
                       o_bias=move(self.o_bias), k_norm_rms=move_norm(self.k_norm_rms),
                       q_norm_rms=move_norm(self.q_norm_rms))


@dataclass
class MLPSpec:
    """One MLP sub-block: y = down(act(gate(x)) * up(x)) for gated MLPs, down(act(up(x))) otherwise."""

    layer: int
    up: torch.Tensor  # (inter, hidden)
    down: torch.Tensor  # (hidden, inter)
    gate: torch.Tensor | None  # (inter, hidden) for SwiGLU/GeGLU
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate_bias: torch.Tensor | None
    activation: str  # "silu", "gelu_pytorch_tanh", "relu", ...
    act_fn: Callable[[torch.Tensor], torch.Tensor] = field(repr=False, default=torch.relu)


class Adapter:
    """Base class; subclasses fill in the family-specific attribute paths."""

    model_types: ClassVar[tuple[str, ...]] = ()
    qk_norm: ClassVar[QKNorm | None] = None  # the family's QK-norm, put in every AttentionSpec; None: no QK-norm

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # an HF PreTrainedModel; its submodules are reached by attribute
        self.config: Any = model.config

    # --- structure -------------------------------------------------------------------------
    def decoder_layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def num_layers(self) -> int:
        return len(self.decoder_layers())

    def attention(self, i: int) -> nn.Module:
        return self._attn_parent(i).get_submodule(self._attn_name())

    def _attn_parent(self, i: int) -> nn.Module:
        return self.decoder_layers()[self._check_layer(i)]

    def _attn_name(self) -> str:
        return "self_attn"

    def replace_attention(self, i: int, module: nn.Module) -> nn.Module:
        """Install `module` as layer i's attention; returns the module it replaced."""
        parent = self._attn_parent(i)
        old = parent.get_submodule(self._attn_name())
        setattr(parent, self._attn_name(), _on_device_of(module, old))
        return old

    def replace_attention_norm(self, i: int, module: nn.Module) -> nn.Module:
        """Install `module` (e.g. nn.Identity) as layer i's pre-attention norm; returns the one replaced.

        Generic: finds the direct child of the decoder layer that `attention_norm(i)` returns.
        """
        layer, norm = self.decoder_layers()[self._check_layer(i)], self.attention_norm(i)
        for name, child in layer.named_children():
            if child is norm:
                setattr(layer, name, module)
                return norm
        raise AttnslimError(
            f"layer {i}: the pre-attention norm {type(norm).__name__} is not a direct child of the decoder "
            f"layer in {type(self).__name__}; override replace_attention_norm for this family"
        )

    def refuse_offload(self) -> None:
        """Raise an AttnslimError naming the reason and the fix if weights on disk (`--offload`, offload/) cannot
        serve this family's layers; nothing for the families whose module names are their checkpoint's names."""

    def linear(self, i: int, name: str) -> nn.Module:
        """The module behind a canonical linear name (q, k, v, o, gate, up, down) of layer i."""
        return self.decoder_layers()[self._check_layer(i)].get_submodule(self._linear_path(i, name))

    def _linear_path(self, i: int, name: str) -> str:
        path = self.linear_paths().get(name)
        if path is None:
            raise AttnslimError(
                f"layer {i}: linear {name!r} does not exist in {type(self).__name__}; "
                f"valid names: {sorted(self.linear_paths())}"
            )
        return path

    def replace_linear(self, i: int, name: str, module: nn.Module) -> None:
        """Install `module` in place of layer i's canonical linear `name`."""
        path = self._linear_path(i, name)
        parent_path, _, attr = path.rpartition(".")
        layer = self.decoder_layers()[self._check_layer(i)]
        owner = layer.get_submodule(parent_path) if parent_path else layer
        setattr(owner, attr, _on_device_of(module, getattr(owner, attr)))

    def linear_paths(self) -> dict[str, str]:
        """Canonical linear name -> dotted path inside a decoder layer."""
        raise NotImplementedError

    def attention_heads(self, i: int) -> AttentionHeads:
        """Layer i's head counts and head_dim, from the config (never from the weights)."""
        raise NotImplementedError

    def attention_spec(self, i: int) -> AttentionSpec:
        raise NotImplementedError

    def mlp_spec(self, i: int) -> MLPSpec:
        raise NotImplementedError

    def attention_norm(self, i: int) -> nn.Module:
        """The norm applied to the residual stream right before attention."""
        raise NotImplementedError

    def mlp_norm(self, i: int) -> nn.Module:
        """The norm applied to the residual stream right before the MLP (exporters read it)."""
        raise AttnslimError(f"{type(self).__name__} does not name its pre-MLP norm (needed to export this family)")

    def final_norm(self) -> nn.Module:
        """The norm after the last decoder layer (exporters read it)."""
        raise AttnslimError(f"{type(self).__name__} does not name its final norm (needed to export this family)")

    def attention_output_norm(self, i: int) -> nn.Module | None:
        """Norm applied to the attention output before the residual add (Gemma3), else None."""
        return None

    def rotary_embedding(self, layer_type: str = "full_attention") -> nn.Module | None:
        """The model's rotary module producing (cos, sin) for position ids, or None."""
        return None

    def layer_types(self) -> list[str]:
        """Per-layer attention type ("full_attention" / "sliding_attention").

        Without `config.layer_types`, a config with a `sliding_window` (Mistral) slides in every layer.
        """
        types = getattr(self.config, "layer_types", None)
        if types:
            return list(types)
        uniform = "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"
        return [uniform] * self.num_layers()

    def cached_rows(self, i: int, context: int) -> int:
        """Rows layer i's cache holds, and a decode step reads, at `context` tokens: all of them, or at most the
        window in a sliding-window layer (HF's sliding cache layers keep only the window)."""
        window = getattr(self.config, "sliding_window", None)
        sliding = self.layer_types()[self._check_layer(i)] == "sliding_attention"
        return min(context, int(window)) if sliding and window else context

    def embed_tokens(self) -> nn.Module:
        raise NotImplementedError

    def embeddings(self) -> list[nn.Module]:
        """Modules counted as the "embedding" parameter group (token and learned position tables)."""
        return [self.embed_tokens()]

    def _check_layer(self, i: int) -> int:
        n = self.num_layers()
        if not 0 <= i < n:
            raise AttnslimError(f"layer index {i} out of range: the model has {n} layers (0..{n - 1})")
        return i

    # --- the output head (a model-level step: methods/head.py) -----------------------------------
    def output_head(self) -> nn.Module:
        """The module mapping the final hidden states to logits (transformers' output embeddings)."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Module):
            raise AttnslimError(f"{type(self.model).__name__} has no output head (get_output_embeddings() is None)")
        return head

    def head_tied(self) -> bool:
        """Whether the output head's weight is the token embedding's (one Parameter: tied)."""
        weight, table = getattr(self.output_head(), "weight", None), getattr(self.embed_tokens(), "weight", None)
        return isinstance(weight, torch.Tensor) and weight is table

    # --- parameter groups --------------------------------------------------------------------
    def param_groups(self) -> dict[str, int]:
        """Parameter counts per group, from the real tensors (tied weights counted once)."""
        seen: set[int] = set()
        groups = {"attention": 0, "mlp": 0, "embedding": 0, "head": 0, "other": 0}
        attn_ids: set[int] = set()
        mlp_ids: set[int] = set()
        mlp_names = [name for name in MLP_LINEARS if name in self.linear_paths()]
        for i in range(self.num_layers()):
            attn_ids |= {id(p) for p in self.attention(i).parameters()}
            # via the canonical linears, so MLPs without a container module (OPT's fc1/fc2) count too
            mlp_ids |= {id(p) for name in mlp_names for p in self.linear(i, name).parameters()}
        embed_ids = {id(p) for m in self.embeddings() for p in m.parameters()}
        # the output head's own parameters; a head tied to the embedding is counted there, once
        head_ids = {id(p) for p in self.output_head().parameters()} - embed_ids
        for p in self.model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = (
                "attention" if id(p) in attn_ids else
                "mlp" if id(p) in mlp_ids else
                "embedding" if id(p) in embed_ids else
                "head" if id(p) in head_ids else "other"
            )
            groups[key] += p.numel()
        groups["total"] = sum(groups.values())
        return groups

    def mlp(self, i: int) -> nn.Module:
        """Layer i's MLP container module (families without one raise)."""
        return self.decoder_layers()[self._check_layer(i)].get_submodule("mlp")

    # --- spec builders shared by adapters ------------------------------------------------------
    def _linear_weights(self, i: int, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [out, in], bias or None) of canonical linear `name`, detached."""
        lin = self.linear(i, name)
        weight, bias = getattr(lin, "weight", None), getattr(lin, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise AttnslimError(
                f"layer {i}: linear {name!r} is a {type(lin).__name__} without a dense weight; "
                "read specs before replacing linears"
            )
        return weight.detach(), bias.detach() if isinstance(bias, torch.Tensor) else None

    def _attention_spec_from_linears(self, i: int, **fields: Any) -> AttentionSpec:
        """AttentionSpec with q/k/v/o weights/biases from the canonical linears, head counts from
        `attention_heads(i)` and the family's `qk_norm`; `fields` gives the rest."""
        tensors: dict[str, Any] = {}
        for name in ATTENTION_LINEARS:
            tensors[name], tensors[f"{name}_bias"] = self._linear_weights(i, name)
        if self.qk_norm is not None:
            attn = self.attention(i)
            q_norm, k_norm = attn.get_submodule(self.qk_norm.q), attn.get_submodule(self.qk_norm.k)
            tensors.update(q_norm=q_norm, k_norm=k_norm, q_norm_rms=self.qk_norm.rms(q_norm),
                           k_norm_rms=self.qk_norm.rms(k_norm))
        heads = self.attention_heads(i)
        return AttentionSpec(layer=i, hidden_size=self.config.hidden_size, n_heads=heads.n_heads,
                             n_kv_heads=heads.n_kv_heads, head_dim=heads.head_dim, **tensors, **fields)

    def _mlp_spec_from_linears(
        self, i: int, activation: str, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> MLPSpec:
        """MLPSpec from the canonical linears; `gate` is None when the family has no gate linear."""
        up, up_bias = self._linear_weights(i, "up")
        down, down_bias = self._linear_weights(i, "down")
        gate, gate_bias = self._linear_weights(i, "gate") if "gate" in self.linear_paths() else (None, None)
        return MLPSpec(
            layer=i, up=up, down=down, gate=gate, up_bias=up_bias, down_bias=down_bias,
            gate_bias=gate_bias, activation=activation, act_fn=act_fn,
        )


def _on_device_of(module: nn.Module, old: nn.Module) -> nn.Module:
    """`module` moved (in place) to the device of the module it replaces, so a conversion of a model on a GPU
    never leaves new parameters on the CPU; dtypes are left as the module chose them. A module on the meta device
    (an offloaded layer's own, put back after a trial) stays there: its weights are read in when it runs."""
    param = next(old.parameters(), None)
    if param is None or param.is_meta or any(p.is_meta for p in module.parameters()):
        return module
    return module.to(param.device)
