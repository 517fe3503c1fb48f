"""`atp`: attention on the top-r principal keys (ATP, Niu, Prakash, Avestimehr; seed 004, paper §4).

What is approximated: each attention layer's softmax over the L tokens of a sequence.
  form="paper"    `PrincipalKeyAttention`: per sequence X ≈ U·X′ (rank r, exact SVD or the paper's Alg. 1); all
                  L queries attend to the r principal keys K′ = Uᵀ·RoPE(K) and values V′ = UᵀV (softmax, Fig. 2;
                  `kernel: taylor` is Eq. 8's first-order form). NOT causal: prompt-level scoring at the last
                  position (the paper's MMLU/BoolQ protocol), never generation.
  form="serving"  `PrincipalCacheAttention`: exact causal prefill, then the prompt's K/V are compressed to r
                  entries (+ an exact recent `window`) that generated tokens attend to (`compress`: hybrid,
                  principal, principal-mix, and the equal-budget baselines recent and sink). Not in the paper.
Statistics needed: none (decompositions are per sequence, online). Weights stay the original q/k/v/o.
Cost: parameters unchanged. Paper form: attention O(L·r·d′) + one SVD per layer per sequence; no decoding.
  Serving form: a KV cache of min(r, P − window) + window + generated entries per layer instead of P + generated.
Deviations: r = ⌈f·L⌉ of the real (unpadded) length; sliding-window and soft-capped layers are refused (the paper's
  models have neither); `value_scale: inv_sqrt_len` (V′/√L) is an ablation the paper does not have.
Recovery (paper form): `recover: {steps, loss, lr, scope, ...}`, LoRA on q/k/v as the paper (train/lora.py),
  merged into the weights after the step, so the saved model is a plain ATP model.
Measured: BENCHMARKS.md, sections "ATP: attention on principal keys" and "ATP: recovery ..." (archive); the full
  account of the forms, the deviations and the recovery runs is docs/methods/atp.md.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.modules.principal import KERNELS, KEY_PATHS, QUERY_MODES, VALUE_SCALES, PrincipalKeyAttention
from attnslim.modules.principal_serving import COMPRESSORS, PrincipalCacheAttention
from attnslim.plan import LayerEntry, StepPlan
from attnslim.registry import register_method

FORMS = ("paper", "serving")


@dataclass(frozen=True)
class AtpEntry(LayerEntry):
    module: str  # the replacement module's class (PrincipalKeyAttention | PrincipalCacheAttention)
    rank: int | float  # the method's rank, as given


@register_method("atp")
@dataclass(frozen=True)
class Atp(Method[AtpEntry, None]):
    entry_type = AtpEntry
    rank: int | float = 0.5  # an int r ≥ 1, or a fraction of the sequence (paper) / prompt (serving) length
    form: str = "paper"
    svd: str = "exact"  # exact | approx (the paper's Alg. 1)
    iters: int = 2  # Alg. 1 inner iterations (paper: 2)
    query: str = "lowrank"  # paper form: lowrank (Q = U·X′W_q, paper) | full
    key_path: str = "cheap"  # paper form: cheap (RoPE(U·X′W_k)) | full (RoPE(X W_k)), both projected by Uᵀ
    value_scale: str = "none"  # paper form: none (paper) | inv_sqrt_len (an ablation not in the paper: V′ / √L)
    kernel: str = "softmax"  # paper form: softmax (Fig. 2, Table 1) | taylor (Eq. 8's first-order form, an ablation)
    window: int = 32  # serving form: exact recent tokens kept beside the compressed prompt
    compress: str = "hybrid"  # serving form: hybrid | principal | principal-mix | recent | sink
    sinks: int = 4  # serving form: first real tokens always kept exactly (attention sinks); not for "recent"
    mass: bool = True  # serving form, compress=principal|hybrid: dropped tokens' softmax mass moves to the nearest key
    recover: dict[str, Any] | None = None  # paper form: a LoraRecipe mapping (train/lora.py) trained after conversion
    sequential = False

    def __post_init__(self) -> None:
        name = "atp"
        rank_ok = not isinstance(self.rank, bool) and (
            (isinstance(self.rank, int) and self.rank >= 1) or (isinstance(self.rank, float) and 0.0 < self.rank <= 1.0)
        )
        require(rank_ok, name, "rank", self.rank, "an int r >= 1 or a fraction in (0, 1] of the sequence length")
        require(self.form in FORMS, name, "form", self.form, " | ".join(FORMS))
        require(self.svd in ("exact", "approx"), name, "svd", self.svd, "exact | approx")
        require(isinstance(self.iters, int) and self.iters >= 1, name, "iters", self.iters, "an int >= 1")
        require(self.query in QUERY_MODES, name, "query", self.query, " | ".join(QUERY_MODES))
        require(self.key_path in KEY_PATHS, name, "key_path", self.key_path, " | ".join(KEY_PATHS))
        require(self.value_scale in VALUE_SCALES, name, "value_scale", self.value_scale, " | ".join(VALUE_SCALES))
        require(self.kernel in KERNELS, name, "kernel", self.kernel, " | ".join(KERNELS))
        require(self.form == "paper" or self.kernel == "softmax", name, "kernel", self.kernel,
                "softmax with form serving (its prefill is exact attention)")
        require(self.kernel == "softmax" or self.value_scale == "none", name, "value_scale", self.value_scale,
                "none with kernel taylor (its L + s·(1U)ᵀ denominator already normalises; V′/√L would rescale it)")
        require(isinstance(self.window, int) and self.window >= 0, name, "window", self.window, "an int >= 0")
        require(self.compress in COMPRESSORS, name, "compress", self.compress, " | ".join(COMPRESSORS))
        require(isinstance(self.sinks, int) and self.sinks >= 0, name, "sinks", self.sinks, "an int >= 0")
        require(isinstance(self.mass, bool), name, "mass", self.mass, "true | false")
        if self.recover is not None:
            require(self.form == "paper", name, "recover", self.recover,
                    "null with form serving (its prefill is exact attention; recovery trains the paper form)")
            self.lora_recipe()  # unknown keys and bad values fail before any layer is converted

    def plan(self, adapter: Adapter, layers: list[int], stats: Mapping[int, None],
             context: StepContext = NO_CONTEXT) -> StepPlan[AtpEntry]:
        entries = {}
        for i in layers:
            spec = adapter.attention_spec(i)
            require(spec.sliding_window is None and spec.softcap is None, "atp", "layers", i,
                    "full-attention layers without soft-capping (this one slides or soft-caps)")
            entries[i] = AtpEntry(self._module_name(), self.rank)
        return StepPlan(entries)

    def convert(self, adapter: Adapter, layer: int, entry: AtpEntry, stats: None) -> Fit:
        self.skeleton(adapter, layer, entry)  # the module copies the original weights from the spec
        return None

    def lora_recipe(self) -> Any:
        """The `recover` mapping as a train/lora.py LoraRecipe (validated there)."""
        from attnslim.settings import config_from_mapping
        from attnslim.train.lora import LoraRecipe

        return config_from_mapping(LoraRecipe, "atp.recover", self.recover)

    @property
    def trains(self) -> bool:
        return self.recover is not None

    def train_step(self, model: Any, tokenizer: Any, teacher: Any, progress: bool = True) -> dict[str, Any]:
        """LoRA recovery after the conversion, merged into the weights; returns the training log. The recipe's
        scope picks the layers: "all" (default, the measured setting: q/k/v of every layer, so unconverted layers
        help compensate) or "converted" (only the layers holding an ATP module, e.g. after another method)."""
        from attnslim.adapters import get_adapter
        from attnslim.train.lora import recover_with_lora

        adapter, atp_types = get_adapter(model), (PrincipalKeyAttention, PrincipalCacheAttention)
        converted = [i for i in range(adapter.num_layers()) if isinstance(adapter.attention(i), atp_types)]
        with tempfile.TemporaryDirectory(prefix="attnslim-atp-lora-") as work:
            _, log = recover_with_lora(model, tokenizer, self.lora_recipe(), work, progress=progress,
                                       teacher=teacher, converted=converted)
        return {k: log[k] for k in ("step", "seconds", "recipe")} | {"final_loss": log["losses"][-1]}

    def skeleton(self, adapter: Adapter, layer: int, entry: AtpEntry) -> None:
        adapter.replace_attention(layer, self.build(adapter.attention_spec(layer)))

    def build(self, spec: AttentionSpec) -> nn.Module:
        """The replacement module for one AttentionSpec (weights copied from the spec)."""
        if self.form == "paper":
            return PrincipalKeyAttention(
                spec, self.rank, self.svd, self.iters, self.query, self.key_path, self.value_scale,  # type: ignore[arg-type]
                kernel=self.kernel,
            )
        return PrincipalCacheAttention(
            spec, self.rank, self.window, self.compress, self.sinks, self.mass, self.svd, self.iters  # type: ignore[arg-type]
        )

    def _module_name(self) -> str:
        return "PrincipalKeyAttention" if self.form == "paper" else "PrincipalCacheAttention"
