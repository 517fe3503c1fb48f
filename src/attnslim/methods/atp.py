"""`atp`: attention on top-r principal keys (ATP, Niu, Prakash, Avestimehr; seed 004, notes methods/atp.md).

What is approximated: each attention layer's softmax over the L tokens of a sequence.
  form="paper"    `PrincipalKeyAttention`: per sequence X ≈ U·X′ (rank r, exact SVD or Alg. 1); all L queries
                  attend to the r principal keys K′ = Uᵀ·RoPE(K) and values V′ = UᵀV. NOT causal: for
                  prompt-level scoring at the last position (the paper's MMLU/BoolQ protocol), never generation.
  form="serving"  `PrincipalCacheAttention`: exact causal prefill, then the prompt's K/V are compressed to r
                  entries (+ an exact recent `window`) that generated tokens attend to. `compress` picks the
                  compression: "principal" (`sinks` first tokens + the top principal subspace of the layer
                  input in its interpolative basis: the keys/values of the tokens that span it, with the dropped
                  tokens' softmax mass merged into the most similar kept key when `mass`), "hybrid" (half the
                  budget to the most recent prompt tokens, half to principal picks among the older ones),
                  "principal-mix" (the paper's UᵀK, UᵀV), and the equal-budget baselines "recent" and "sink".
Statistics needed: none (decompositions are per sequence, online). Weights stay the original q/k/v/o.
Cost: parameters unchanged. Paper form: attention O(L·r·d′) + SVD per layer per sequence; no decoding.
  Serving form: KV cache min(r, P − window) + window + generated entries per layer instead of P + generated,
  each 2·n_kv·head_dim values; compression costs one SVD (n × d) + r pivot steps per layer at the prompt's end.
Deviations from the paper, and why:
  - the serving form is not in the paper (it never generates); its default basis is interpolative because
    softmax is not rotation-invariant (see modules/principal_serving.py);
  - r = ⌈f·L⌉ uses the real (unpadded) length; fractions of the prompt length P in the serving form;
  - layers with sliding windows or soft-capping are refused (the paper's models have neither);
  - `value_scale="inv_sqrt_len"` (V′/√L, notes G8) is an ablation the paper does not have (default off, so the
    layer is the paper's). It is the better drop-in setting: at 1/2 keys on SmolLM2-135M (benchmarks/atp.py,
    100 next-word items, dense 0.96) it lifts all 30 layers from chance (0.25) to 0.53 and the last 3 layers
    from 0.68 to 0.97.
Recovery training (paper form): `recover: {steps: 150, loss: kd, lr: 1e-3, ...}` (a train/lora.py LoraRecipe:
  LoRA rank 32 on q/k/v as the paper) runs after the step's conversion against the model before the recipe's
  first step, and merges the adapters into q/k/v, so the saved model is a plain ATP model. Measured on all 30
  layers at 1/2 keys with V′/√L (0.53 drop-in): "kd" at lr 1e-3 gives 0.67 after 150 steps and 0.61 after 300 (a
  plateau at batch 4 × 256; the paper trains on ~85× more tokens). On the 15 layers whose lone conversion
  costs least (`attnslim analyze --what conversion`): 0.80 drop-in, 0.94 after 80 "kd" steps (dense 0.96;
  recipes/atp-paper.yaml). Converting in stages (analysis/progressive.py, a multi-step recipe) does not do better
  on all 30 layers: 15 → 22 → 26 → 28 → 30 layers with 80 steps each give 0.94 → 0.86 → 0.74 → 0.72 → 0.66.
  The paper's own recovery, fine-tuning on the task (loss "choice": next-word items of the calibration split),
  does not help either: 100 steps after the 150 "kd" steps give 0.65.
  Why all layers are hard: the layer is not attention over the tokens even with every key kept, since softmax
  over the rotated basis UᵀK is not softmax over K; at r = L, SmolLM2's layers 0 and 1 cost 0.61 and 1.20 nats
  alone, as at r = L/2 (0.61, 1.14; `attnslim analyze smollm2-135m --what conversion --seq-len 256 --layers
  0,1,2,24 --arg value_scale=inv_sqrt_len --arg rank=1.0`), and query/key_path "full" change nothing. Recovery
  must re-learn the attention patterns rather than restore dropped components. See BENCHMARKS.md, ATP recovery.
  `recover: {scope: all}` (default, as measured) puts LoRA on the q/k/v of every layer, converted or not;
  `scope: converted` only on the layers holding an ATP module, e.g. after a step of another method whose
  factored projections LoRA cannot wrap (train/lora.py lora_targets refuses those with this hint).
  Inside compress the checkpoints go to a temporary directory; for a resumable run call
  `attnslim.train.lora.recover_with_lora` with an `out_dir`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from attnslim.adapters.base import Adapter, AttentionSpec
from attnslim.methods.base import NO_CONTEXT, Fit, Method, StepContext, require
from attnslim.modules.principal import KEY_PATHS, QUERY_MODES, VALUE_SCALES, PrincipalKeyAttention
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
    value_scale: str = "none"  # paper form: none (paper) | inv_sqrt_len (notes G8 ablation: V′ / √L)
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
                spec, self.rank, self.svd, self.iters, self.query, self.key_path, self.value_scale  # type: ignore[arg-type]
            )
        return PrincipalCacheAttention(
            spec, self.rank, self.window, self.compress, self.sinks, self.mass, self.svd, self.iters  # type: ignore[arg-type]
        )

    def _module_name(self) -> str:
        return "PrincipalKeyAttention" if self.form == "paper" else "PrincipalCacheAttention"
