"""`attnslim export DIR --to deepseek-v3 --out OUT`: an attnslim output whose every layer is MLA, as a stock
`DeepseekV3ForCausalLM` checkpoint. transformers loads it with plain `AutoModelForCausalLM.from_pretrained(OUT)`
(no remote code, no attnslim) and vLLM serves it with its own MLA kernels; the layer map is in deepseek_layer.py.

Exact by construction, up to float rounding:
- the rotary key: DeepSeek's qk_rope_head_dim is the model's rotary width, so DeepSeek's frequency f is the
  model's frequency f (its rope_parameters are copied: scaled RoPE stays the model's own); each kept pair goes to
  its frequency's slot, permuted into DeepSeek's interleaved layout. Two kept pairs at one frequency cannot
  share a slot: refused (compress with `layout: deepseek`, which keeps one per frequency). For a served width
  on 128-dim heads, pairs kept only at even frequencies (mla `rope_stride: 2`) or the 32 fastest (`rope_fastest:
  32`) go to a 64-dim key, at the same rope_theta or at its square root (`deepseek_rotary`).
- the softmax scale: DeepSeek's (d_qn + D)^-½ is folded into q_proj.
- ranks: every layer's latent is zero-padded to one kv_lora_rank: the largest layer rank by default, or with
  --kv-lora-rank a width vLLM serves (`auto`: the smallest that holds the latent; attnslim/mla_widths.py lists them).
  The padded latent dims are zero for every input (zero rows of kv_a_proj_with_mqa, zero columns of kv_b_proj).
- MLP: copied (gate, up, down); DeepSeek's MLP has no biases, so a source MLP with biases is refused.
- no MoE: first_k_dense_replace = the layer count (transformers and vLLM then build the dense MLP everywhere).
Approximate, with a bound:
- kv_a_layernorm, an RMSNorm of the latent that DeepSeek always applies, is made linear: the latent map is
  scaled by α so that mean (α c)² ≤ 1e-6 · eps for any input (‖x‖ ≤ √d · max|γ| after the pre-attention
  RMSNorm), and the norm weight is √eps / α; relative error ≤ 5e-7.
- eps, made exact by rescaling the residual stream: transformers builds kv_a_layernorm with eps 1e-6 whatever the
  config says, vLLM with rms_norm_eps, so the export writes rms_norm_eps = 1e-6 and every RMSNorm uses it. For a
  source eps ε ≠ 1e-6, the residual stream is scaled by s = √(1e-6/ε) (embeddings, and every write to the stream:
  o_proj and down_proj): an RMSNorm of s·h with eps s²·ε equals the source's RMSNorm of h with ε, exactly, and
  what reads the stream only through a norm (attention, MLP, lm_head after the final norm) is unchanged.
Refused, naming the layers: non-MLA layers, sliding-window layers, a factorised q_proj or MLP, QK-norm, RoPE types
other than the plain one (vLLM's DeepSeek model reads them as DeepSeek's YaRN variants), attention biases
(DeepSeek-V3 and vLLM have none; with --drop-biases they are dropped and the verification measures what that
costs; a Qwen-family model exports when compressed with `layout: deepseek, biases: fold`, which folds its q/k/v
biases into the weights), float16 (α A underflows it).
Verified before the output appears: the written directory is loaded by transformers alone and its logits compared
with the source model's on wiki text; the numbers go to attnslim-export.json, and a float32 export whose logits
differ by more than TOLERANCE is refused (a bug, not a rounding).
vLLM serves kv_lora_rank 256 or 512 with a 64-dim rotary key (widths 320 and 576); its CPU kernel runs only 512:
pass --kv-lora-rank 512 to serve on CPU, `auto` for the smallest width a GPU backend takes (docs/serving.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.data import eval_windows
from attnslim.disk_format import EXPORT_MARKER
from attnslim.engines import DEEPSEEK_BASES
from attnslim.errors import AttnslimError
from attnslim.export.common import span, weight, write_weights
from attnslim.export.deepseek_layer import MLALayer, attention_tensors, latent_scale
from attnslim.mla_widths import AUTO, VLLM_LORA_RANKS, VLLM_ROPE, check_served_rank, check_served_rope, served_rank
from attnslim.modules.mla import MLAAttention
from attnslim.offload import check_free_disk
from attnslim.outdir import check_output, staged_output
from attnslim.safe_files import read_json

EPS = 1e-6  # transformers' fixed kv_a_layernorm eps, written as rms_norm_eps so that vLLM uses it too
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# vLLM's DeepSeek model turns every other RoPE type into one of DeepSeek's YaRN variants (deepseek_v2.py)
ROPE_TYPES = ("default",)
# largest |Δ logit| / max |logit| of a float32 export with its biases kept: far above float rounding and the
# kv_a_layernorm bound (tests/test_export.py's real test bounds the export itself at 1e-4), far below the O(1)
# errors of a wrong map
TOLERANCE = 1e-3
VERIFY_SOURCE = "wiki"


@dataclass(frozen=True)
class ExportOptions:
    # None: the largest latent rank of any layer (transformers loads any rank; vLLM serves only 320/512/576 wide);
    # "auto": the smallest rank vLLM serves that holds it (mla_widths: 256 -> width 320, else 512 -> 576); an int:
    # one of mla_widths.VLLM_LORA_RANKS
    kv_lora_rank: int | str | None = None
    dtype: str = "float32"
    drop_biases: bool = False
    verify_tokens: int = 512


def export_deepseek(model: Any, tokenizer: Any, out: Path, options: ExportOptions, overwrite: bool = False,
                    source: Path | None = None) -> dict[str, Any]:
    """Write `model` (every layer MLAAttention) to `out` as a DeepseekV3ForCausalLM checkpoint; returns the
    verification report also written to out/attnslim-export.json."""
    check_output(out, overwrite, [source] if source else [])
    dtype = _dtype(options.dtype)
    # the checkpoint holds at most the model's parameters in `dtype`: a full disk fails now, not after the work
    check_free_disk(out, sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=dtype).element_size())
    adapter = get_adapter(model)
    layers = mla_layers(adapter)
    rotary = deepseek_rotary(layers, served=options.kv_lora_rank is not None)
    rank = _kv_lora_rank(layers, options.kv_lora_rank, rotary.dims)
    dropped = _check_biases(layers, options.drop_biases)
    config = deepseek_config(adapter, layers, rank, options.dtype, rotary)
    state = deepseek_state(adapter, layers, rank, rotary)
    with staged_output(out, overwrite) as tmp:
        _compat.config_from_dict("deepseek_v3", config).save_pretrained(tmp)
        write_weights({k: v.to(dtype) for k, v in state.items()}, tmp)
        del state
        tokenizer.save_pretrained(tmp)
        report = verify(model, tokenizer, tmp, options)
        report.update(kv_lora_rank=rank, qk_rope_head_dim=config["qk_rope_head_dim"], dtype=options.dtype,
                      dropped_biases=dropped, kv_elements_per_token_and_layer=rank + config["qk_rope_head_dim"],
                      dense_kv_elements_per_token_and_layer=2 * layers[0].n_kv_heads * layers[0].head_dim,
                      latent_ranks=[m.rank for m in layers], rope_dims=[m.rope_dims for m in layers])
        (tmp / EXPORT_MARKER).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def _dtype(name: str) -> torch.dtype:
    if name == "float16":
        raise AttnslimError("--dtype float16 cannot hold the export's scaled latent map (it underflows float16's "
                            "range); use bfloat16 or float32")
    if name not in DTYPES:
        raise AttnslimError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def mla_layers(adapter: Adapter) -> list[MLAAttention]:
    """Every decoder layer's MLAAttention, or a refusal naming the layers that are not."""
    model_type = str(adapter.config.model_type)
    if model_type not in DEEPSEEK_BASES:
        raise AttnslimError(f"export to deepseek-v3 supports {', '.join(DEEPSEEK_BASES)} models; "
                            f"this one is {model_type!r}")
    found = [adapter.attention(i) for i in range(adapter.num_layers())]
    other = [i for i, m in enumerate(found) if not isinstance(m, MLAAttention)]
    if other:
        kinds = sorted({type(found[i]).__name__ for i in other})
        raise AttnslimError(f"layers {span(other)} are not MLA ({', '.join(kinds)}): a DeepSeek-V3 checkpoint is "
                            "MLA in every layer; compress every layer with method mla or transmla")
    layers = [m for m in found if isinstance(m, MLAAttention)]
    for i, m in enumerate(layers):
        where = f"layer {i}"
        if m.sliding_window is not None:
            raise AttnslimError(f"{where} attends over a sliding window, which DeepSeek-V3 has no field for")
        if m.q_norm is not None or m.softcap is not None:
            raise AttnslimError(f"{where} has a query norm or a logit softcap, which DeepSeek-V3 has no field for")
        if m.key_norm is not None:
            raise AttnslimError(f"{where} caches key scales (the model's key norm), which DeepSeek-V3 has no field for")
        if type(m.q_proj) is not nn.Linear:
            raise AttnslimError(f"{where}: q_proj is a {type(m.q_proj).__name__}; export needs a dense q_proj "
                                "(compress without a step that factorises q)")
        freq = [] if m.rope_freq is None else m.rope_freq.tolist()
        doubled = sorted({f for f in freq if freq.count(f) > 1})
        if doubled:
            raise AttnslimError(f"{where} keeps more than one rotary pair at each of frequencies {doubled}; "
                                "DeepSeek-V3's rotary key has one slot per frequency: compress with `layout: deepseek` "
                                "(recipe mla-deepseek)")
        for name in ("gate", "up", "down"):
            lin = adapter.linear(i, name)
            if type(lin) is not nn.Linear or lin.bias is not None:
                raise AttnslimError(f"{where}: MLP {name} is a {type(lin).__name__}"
                                    f"{' with a bias' if type(lin) is nn.Linear else ''}; DeepSeek-V3's dense MLP "
                                    "is three Linears without biases")
    return layers


def check_kv_lora_rank_in(directory: Path, wanted: int | str | None) -> None:
    """--kv-lora-rank checked from `directory`'s config.json, so `export` refuses it before loading the model: an
    explicit rank must be one vLLM serves, and a served width needs the 64-dim rotary key (the rotary width of a
    config without a plain head_dim or with partial rotary is left to the check after loading, which always runs)."""
    if wanted is None:
        return
    if wanted != AUTO:
        check_served_rank(wanted)
    config = read_json(directory / "config.json", "config", fix="re-create the directory with attnslim compress")
    if not isinstance(config, dict) or "partial_rotary_factor" in config:
        return
    heads, head_dim, hidden = (config.get(k) for k in ("num_attention_heads", "head_dim", "hidden_size"))
    if not isinstance(heads, int) or heads < 1:
        return
    width = head_dim if isinstance(head_dim, int) else hidden // heads if isinstance(hidden, int) else 0
    if width > 0 and (width < VLLM_ROPE or width % VLLM_ROPE):  # 128: mla rope_stride 2 serves it (checked later)
        check_served_rope(width)


def _kv_lora_rank(layers: list[MLAAttention], wanted: int | str | None, rope: int) -> int:
    """The exported latent width (padding with zeros is exact): the largest layer rank (None), the smallest rank
    vLLM serves that holds it (`auto`), or `wanted`, which must be a served rank (mla_widths.VLLM_LORA_RANKS) no
    smaller than the largest layer rank. Only served ranks are taken: a wider latent than the layers need buys
    nothing but a vLLM width, and each unit of it costs every layer a float64 row of kv_b (an unchecked 100000
    asked for 1.4 GB per layer; reliability round 3, e18/e19)."""
    largest = max(m.rank for m in layers)
    if wanted is None:
        return largest
    if wanted == AUTO:
        return served_rank(largest, rope)
    wanted = check_served_rank(wanted)
    check_served_rope(rope)
    if wanted < largest:
        worst = [i for i, m in enumerate(layers) if m.rank > wanted]
        fit = [r for r in VLLM_LORA_RANKS if r >= largest]
        fix = f"give {fit[0]} or `auto`" if fit else "compress with a smaller latent"
        raise AttnslimError(f"--kv-lora-rank {wanted} is below the latent rank of layers {span(worst)} (largest "
                            f"{largest}); {fix} (padding is exact, truncating is not)")
    return wanted


def _check_biases(layers: list[MLAAttention], drop: bool) -> list[str]:
    """Names of the nonzero attention biases; refused unless `drop`."""
    found = []
    for i, m in enumerate(layers):
        for name, mod in (("q_proj", m.q_proj), ("o_proj", m.o_proj), ("k_rope", m.k_rope)):
            bias = getattr(mod, "bias", None)
            if isinstance(bias, torch.Tensor) and bool(bias.detach().abs().max() > 0):
                found.append(f"layer {i} {name}")
    if found and not drop:
        raise AttnslimError(f"{span(found, 'in all', 6)} have nonzero biases, which the DeepSeek-V3 model vLLM "
                            "serves cannot hold: vLLM 0.32 builds q_proj, kv_a_proj_with_mqa (the rotary key) and "
                            "o_proj without biases, and DeepSeek-V3 has no q_proj bias at all. Compress with `layout: "
                            "deepseek` (no bias: the latent is fitted without the mean correction; recipes/"
                            "mla-deepseek.yaml) where the model has no q/k/v biases; with q/k/v biases (Qwen), add "
                            "`biases: fold` (folded into the weights by least squares, approximate; docs/serving.md, "
                            "'Biased models'), or serve the free layout with transformers (attnslim.load). "
                            "--drop-biases drops them and writes the cost to attnslim-export.json")
    return found


def deepseek_config(adapter: Adapter, layers: list[MLAAttention], rank: int, dtype: str,
                    rotary: RotaryMap) -> dict[str, Any]:
    """config.json values of the DeepSeek-V3 model (dense MLP in every layer, q_lora_rank null)."""
    cfg = adapter.config
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES or "mscale_all_dim" in rope:
        raise AttnslimError(f"RoPE type {rope_type!r}: vLLM's DeepSeek model reads every RoPE type but "
                            f"{', '.join(ROPE_TYPES)} as one of DeepSeek's YaRN variants, so the export would not be "
                            "the model's own rotation there; supported: " + ", ".join(ROPE_TYPES))
    if rotary.theta_power != 1.0:
        rope["rope_theta"] = float(rope["rope_theta"]) ** rotary.theta_power
    first = layers[0]
    n = adapter.num_layers()
    return {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n, "num_attention_heads": first.n_heads, "num_key_value_heads": first.n_heads,
        "hidden_act": cfg.hidden_act, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": EPS, "rope_parameters": rope, "rope_interleave": True, "attention_bias": False,
        "kv_lora_rank": rank, "q_lora_rank": None, "qk_rope_head_dim": rotary.dims,
        "qk_nope_head_dim": first.head_dim,
        "v_head_dim": first.head_dim, "first_k_dense_replace": n,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
    }


@dataclass(frozen=True)
class RotaryMap:
    """DeepSeek's rotary key for the model's kept pairs: `dims` = qk_rope_head_dim D', pair f at slot f // stride,
    rope_theta raised to `theta_power`. DeepSeek's frequency j is θ'^(-2j/D'); the model's f is θ^(-2f/D)."""

    dims: int
    stride: int = 1
    theta_power: float = 1.0


def deepseek_rotary(layers: list[MLAAttention], served: bool) -> RotaryMap:
    """The model's own rotary width D, or, for an export at a width vLLM serves, VLLM_ROPE where the kept pairs
    allow it exactly: all at frequencies divisible by s = D / VLLM_ROPE (mla `rope_stride`; slot f / s at the same
    θ: θ^(-2(f/s)/D') = θ^(-2f/D)), or all below VLLM_ROPE / 2 (mla `rope_fastest`; slot f at θ' = θ^(D'/D):
    θ'^(-2f/D') = θ^(-2f/D))."""
    rotary = _rotary_dims(layers[0])
    if not served or rotary <= VLLM_ROPE or rotary % VLLM_ROPE:
        return RotaryMap(rotary)
    stride = rotary // VLLM_ROPE
    kept = torch.cat([m.rope_freq for m in layers if m.rope_freq is not None] or [torch.zeros(0, dtype=torch.long)])
    if bool((kept % stride == 0).all()):
        return RotaryMap(VLLM_ROPE, stride=stride)
    if bool((kept < VLLM_ROPE // 2).all()):
        return RotaryMap(VLLM_ROPE, theta_power=VLLM_ROPE / rotary)
    return RotaryMap(rotary)


def _rotary_dims(module: MLAAttention) -> int:
    """The model's rotary width (DeepSeek's qk_rope_head_dim): 2 × the rotary module's frequencies."""
    if not module._rotary:
        raise AttnslimError("the model has no rotary embedding; DeepSeek-V3's rotary key needs one")
    inv_freq = getattr(module._rotary[0], "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise AttnslimError(f"the rotary module {type(module._rotary[0]).__name__} has no inv_freq table")
    return 2 * inv_freq.numel()


def deepseek_state(adapter: Adapter, layers: list[MLAAttention], rank: int,
                   rotary: RotaryMap) -> dict[str, torch.Tensor]:
    """The DeepSeek-V3 state dict (float64 attention tensors, the rest as stored), tensors independent of the
    source's (no shared storage: lm_head is written out). rotary: `deepseek_rotary`."""
    model = adapter.model
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise AttnslimError("the LM head is factored (the recipe's head: section); DeepseekV3ForCausalLM has a dense "
                            "head: compress without head: to export --to deepseek")
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": weight(adapter.embed_tokens()),
        "model.norm.weight": weight(adapter.final_norm()),
        "lm_head.weight": weight(model.get_output_embeddings()),
    }
    d = adapter.config.hidden_size
    scale = residual_scale(adapter)
    state["model.embed_tokens.weight"] *= scale
    for i, m in enumerate(layers):
        p = f"model.layers.{i}."
        norm = weight(adapter.attention_norm(i))
        with torch.no_grad():
            latent = m.kv.dense_latent()  # (r, d)
        alpha = latent_scale(latent, math.sqrt(d) * float(norm.abs().max()), rank, EPS)
        source = MLALayer(
            weight(m.q_proj), _opt(m.q_nope), _opt(m.q_rope),
            m.rope_freq // rotary.stride if m.rope_freq is not None else torch.zeros(0, dtype=torch.long), latent,
            m.kv.b.detach()[: m.nope_dims], m.kv.b.detach()[m.nope_dims :],
            None if m.k_rope is None else weight(m.k_rope), weight(m.o_proj), m.n_heads, m.n_kv_heads, m.scaling)
        tensors = attention_tensors(source, rotary_dims=rotary.dims, kv_lora_rank=rank, alpha=alpha, eps=EPS)
        tensors["o_proj.weight"] = tensors["o_proj.weight"] * scale
        state.update({p + "self_attn." + k: v for k, v in tensors.items()})
        state[p + "input_layernorm.weight"] = norm
        state[p + "post_attention_layernorm.weight"] = weight(adapter.mlp_norm(i))
        for name in ("gate", "up", "down"):
            linear = adapter.linear(i, name)
            if getattr(linear, "bias", None) is not None:
                raise AttnslimError(f"layer {i} {name}_proj has a bias; DeepSeek-V3's MLP has none, so the export "
                                    "cannot carry it")
            state[p + f"mlp.{name}_proj.weight"] = weight(linear) * (scale if name == "down" else 1.0)
    return state


def residual_scale(adapter: Adapter) -> float:
    """s = √(EPS / ε): the residual stream scaled by s makes every RMSNorm with eps EPS compute what the source's
    norms compute with its own ε (RMSNorm(s·h; s²·ε) = RMSNorm(h; ε))."""
    eps = getattr(adapter.config, "rms_norm_eps", None)
    if not isinstance(eps, float) or eps <= 0:
        raise AttnslimError(f"the model's config has no positive rms_norm_eps ({eps!r}); the export needs the "
                            "source's RMSNorm epsilon")
    return math.sqrt(EPS / eps)


def _opt(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.detach()


def verify(model: Any, tokenizer: Any, directory: Path, options: ExportOptions) -> dict[str, Any]:
    """Load `directory` with transformers alone and compare its logits with `model`'s on wiki text."""
    from attnslim.models.load import load_model

    exported, _ = load_model(str(directory))
    seq = min(256, options.verify_tokens)
    ids = eval_windows(VERIFY_SOURCE, tokenizer, tokens=max(seq, options.verify_tokens), seq_len=seq).ids
    with torch.no_grad():
        ref = model(ids).logits.double()
        got = exported(ids).logits.double()
    err = float((ref - got).abs().max())
    rel = err / float(ref.abs().max())
    report = {"verified_on": f"{ids.numel()} tokens of {VERIFY_SOURCE} (evaluation split)",
              "max_abs_logit_error": err, "relative_logit_error": rel,
              "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
              "nll_source": _nll(ref, ids), "nll_export": _nll(got, ids), "tolerance": TOLERANCE}
    del exported
    if rel > TOLERANCE and options.dtype == "float32" and not options.drop_biases:
        raise AttnslimError(f"the exported model's logits differ from the source's by {rel:.2e} of their range "
                            f"(tolerance {TOLERANCE:g}); this is a bug in the export, please report it")
    return report


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

