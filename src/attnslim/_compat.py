"""The only module that knows transformers-version details: masks, caches, attention call signature. What torch's
build and the host offer (BLAS, CPU vendor, oneDNN's linear) is in host.py, which imports torch only.

Decoder layers of transformers 5.x call their attention as
    self_attn(hidden_states=..., position_embeddings=(cos, sin) | absent, attention_mask=..., past_key_values=...,
              cache_position=..., **kw) -> (output (b, t, hidden), attention weights | None)
(Llama/Gemma3 pass `position_embeddings`; OPT passes none). `attention_call` / `attention_output` translate that
for modules/base.ReplacementAttention, so replacement modules never see HF's keyword names.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import DynamicLayer

from attnslim.errors import AttnslimError

# transformers' DynamicLayer reports a sequence length of 0 when its key tensor is empty, and the
# model derives positions and masks from layer 0's length. Layers that store no KV cache therefore
# write a one-byte-per-token marker so positions stay right; `kv_cache_bytes` counts it honestly.
_MARKER_DTYPE = torch.int8

# HF's keyword names of an attention call, in the positional order replacement modules also accept
_CALL_KEYWORDS = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")
# the cache keywords of a module call (4.x spelled the cache `past_key_value`): dropped to replay a call elsewhere
CACHE_KWARGS = ("past_key_values", "past_key_value", "use_cache", "cache_position")


class AttentionCall(NamedTuple):
    """One attention call by meaning. hidden_states (b, t, d); position_embeddings (cos, sin), each (b, t, d_rot),
    or None without RoPE; attention_mask as HF passed it (None, boolean or additive, see `keep_mask`); cache: HF's
    Cache or None."""

    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    attention_mask: torch.Tensor | None
    cache: Any


def attention_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AttentionCall:
    """HF's positional/keyword attention arguments -> AttentionCall (other keywords, e.g. cache_position, unused)."""
    if not args and "hidden_states" in kwargs:  # how HF's decoder layers call attention: keywords only
        return AttentionCall(kwargs["hidden_states"], kwargs.get("position_embeddings"), kwargs.get("attention_mask"),
                             kwargs.get("past_key_values"))
    values = dict(zip(_CALL_KEYWORDS, args, strict=False)) | {k: kwargs[k] for k in _CALL_KEYWORDS if k in kwargs}
    if "hidden_states" not in values:
        raise TypeError("attention called without hidden_states")
    return AttentionCall(values["hidden_states"], values.get("position_embeddings"), values.get("attention_mask"),
                         values.get("past_key_values"))


def attention_output(out: torch.Tensor) -> tuple[torch.Tensor, None]:
    """What a decoder layer expects back from its attention: (output, attention weights = None)."""
    return out, None


def hidden_states_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states of a module call seen by a forward (pre-)hook: first positional or `hidden_states`."""
    return args[0] if args else kwargs["hidden_states"]


def keep_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean (b|1, 1, q_len, kv_len) mask, True = attend, from whatever HF passed, for the kv_len rows
    `cache_update` returned.

    HF passes None (SDPA's causal fast path), a boolean mask, or an additive float mask. With None,
    queries are the last q_len of kv_len positions (causal with offset). HF's mask has a column per row its
    cache layer returned; for a static layer (its whole buffer, unfilled rows last) `cache_update` kept the
    first kv_len rows, so the mask's first kv_len columns are theirs.
    """
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        k_pos = torch.arange(kv_len, device=device)[None, :]
        return (k_pos <= q_pos)[None, None]
    mask = attention_mask[..., -q_len:, :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def cache_update(cache: Any, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, reserve: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Append (b, h, t, d) keys/values (any h, d: latent caches store (b, 1, t, r)); returns every row that holds
    a token so far, the new ones last, as a dynamic cache returns them. A static layer (generate's
    cache_implementation="static") returns its whole preallocated buffer, position j at row j, the rows after the
    tokens seen so far unfilled: those are cut off here, so that attention neither reads nor masks them.
    reserve: a plain dynamic layer still empty becomes a `ReservedRowsLayer` (appends in place)."""
    if cache is None:
        return keys, values
    if reserve:
        reserve_rows(cache, layer_idx)
    k, v = cache.update(keys, values, layer_idx)
    layer = cache.layers[layer_idx]
    if isinstance(layer, DynamicLayer):  # dynamic layers hold the filled rows only
        return k, v
    seen = int(layer.get_seq_length())
    if k.shape[-2] > seen:
        return k[..., :seen, :], v[..., :seen, :]
    return k, v


def cache_mark_tokens(cache: Any, layer_idx: int, hidden_states: torch.Tensor) -> None:
    """For a layer that stores no KV: record t new tokens (1 byte each) so positions stay correct."""
    if cache is None:
        return
    b, t = hidden_states.shape[:2]
    marker = torch.zeros(b, 1, t, 1, dtype=_MARKER_DTYPE, device=hidden_states.device)
    empty = torch.zeros(b, 1, t, 0, dtype=_MARKER_DTYPE, device=hidden_states.device)
    cache.update(marker, empty, layer_idx)


def cache_seq_length(cache: Any, layer_idx: int) -> int:
    """Tokens already seen by layer `layer_idx`'s cache (0 without a cache)."""
    if cache is None or layer_idx >= len(cache.layers):
        return 0
    return int(cache.layers[layer_idx].get_seq_length())


def cache_bytes_per_layer(cache: Any) -> list[int]:
    """Bytes each cache layer really holds: its keys and values tensors, with the rows a `ReservedRowsLayer`
    has reserved beyond them."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, ReservedRowsLayer):
            out.append(layer.reserved_bytes())
            continue
        tensors = [getattr(layer, name, None) for name in ("keys", "values")]
        out.append(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))
    return out


class ReservedRowsLayer(DynamicLayer):
    """A dynamic cache layer that appends into rows reserved ahead, instead of copying every row at every step.

    HF's DynamicLayer concatenates: each decode step copies the whole cache of the layer (T rows read and
    written per new token). Here keys/values are views of the first T rows of a buffer; new rows are written
    in place, and only when the buffer is full is it replaced by one with T/8 (at least 64) more rows, a copy
    every T/8 steps. The first update (prefill) reserves exactly its rows, so a cache measured after a prefill
    holds no spare row; during decode at most max(64, T/8) rows are spare (`reserved_bytes` counts them).
    HF's own methods that replace keys/values (reorder, batch select, offload) leave tensors that are no view
    of the buffer: the next update copies them into a new one. `crop` leaves a view, whose cut rows are then
    overwritten."""

    def __init__(self) -> None:
        super().__init__()
        self._reserve: list[torch.Tensor | None] = [None, None]  # (b, h, capacity, d) behind keys and values
        self._views: list[torch.Tensor | None] = [None, None]  # the filled rows last handed out (keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append(0, self.keys, key_states)
        if value_states.shape[-1] == 0:  # a latent cache's empty value slot: rows to count, nothing to copy
            self.values = self.keys[..., :0]
        else:
            self.values = self._append(1, self.values, value_states)
        return self.keys, self.values

    def _append(self, slot: int, filled: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """filled (b, h, T, d) (or HF's empty start) and new (b, h, t, d) -> the first T + t rows of the buffer."""
        buf = self._reserve[slot]
        rows = filled.shape[-2] if filled is not None and filled.dim() == new.dim() else 0
        need = rows + new.shape[-2]
        # `filled` is the view this layer returned last (the decode step's case), or, after one of HF's methods,
        # a view of the same buffer (crop) or a tensor of its own (reorder, batch select, offload)
        fits = (buf is not None and rows > 0 and need <= buf.shape[-2] and buf.shape[:-2] == new.shape[:-2]
                and buf.shape[-1] == new.shape[-1] and (filled is self._views[slot] or (
                    filled is not None and filled.data_ptr() == buf.data_ptr() and filled.stride() == buf.stride())))
        if buf is None or not fits:
            buf = new.new_empty(*new.shape[:-2], need + (max(64, need // 8) if rows else 0), new.shape[-1])
            if rows and filled is not None:
                buf[..., :rows, :] = filled
            self._reserve[slot] = buf
        buf.narrow(-2, rows, need - rows).copy_(new)  # narrow, not `buf[..., a:b, :]`: no Python index parsing
        view = self._views[slot] = buf.narrow(-2, 0, need)
        return view

    def reserved_bytes(self) -> int:
        """Bytes of both buffers, spare rows included (0 before the first update)."""
        return sum(b.numel() * b.element_size() for b in self._reserve if b is not None)

    def reset(self) -> None:
        self._reserve, self._views = [None, None], [None, None]
        super().reset()


def reserve_rows(cache: Any, layer_idx: int) -> None:
    """Make layer `layer_idx` of a dynamic HF cache a `ReservedRowsLayer` while it is a plain DynamicLayer that
    holds nothing yet; every other layer (static, sliding-window, offloaded, quantized, already filled) is left."""
    layers = cache.layers
    if layer_idx < len(layers):
        if type(layers[layer_idx]) is DynamicLayer and not layers[layer_idx].is_initialized:
            layers[layer_idx] = ReservedRowsLayer()
    elif getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        install_cache_layer(cache, layer_idx, ReservedRowsLayer())


def filled_reserved_layer(cache: Any, layer_idx: int) -> ReservedRowsLayer | None:
    """Layer `layer_idx` of `cache` where it is a `ReservedRowsLayer` already holding rows (a decode step of a
    sequence under way, appending in place), else None."""
    layers = None if cache is None else cache.layers
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if type(layer) is ReservedRowsLayer and layer.is_initialized else None


CACHE_KINDS = ("dynamic", "static", "reserved")


def new_cache(config: Any, kind: str = "dynamic", max_length: int | None = None) -> Any:
    """A fresh cache for `config`: dynamic (what generate() creates by default: each step appends a copy; the MLA
    module turns its layers into `ReservedRowsLayer`s), static (generate's cache_implementation="static": one
    buffer of max_length positions per layer, written in place) or reserved (dynamic, with every full-attention
    layer a `ReservedRowsLayer` from the start, whatever module uses it: e.g. the dense model in the speed
    benchmarks)."""
    from transformers import DynamicCache, StaticCache

    if kind in ("dynamic", "reserved"):
        cache = DynamicCache(config=config)
        if kind == "reserved":
            for i in range(len(cache.layers)):
                reserve_rows(cache, i)
        return cache
    if kind == "static" and max_length is not None and max_length > 0:
        return StaticCache(config=config, max_cache_len=max_length)
    raise AttnslimError(f"cache kind {kind!r} with max_length {max_length!r}: valid kinds {CACHE_KINDS}; "
                        "a static cache needs max_length > 0 (prompt + new tokens)")


def rotary_cos_sin(rotary: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) each (b, t, d_rot) from the model's rotary module (Gemma3 takes a layer type).

    HF wraps `forward` in decorators (`torch.no_grad`, `dynamic_rope_update`), so the wrapper's own
    `__code__` only shows (*args, **kwargs); `inspect.signature` follows `__wrapped__` to the real one.
    """
    if layer_type is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(x, position_ids, layer_type)
    else:
        cos, sin = rotary(x, position_ids)
    return cos, sin


class PrincipalCacheLayer(DynamicLayer):
    """One layer's compressed cache: keys/values (b, n_kv, n_comp + tail, hd), the compressed entries' logit
    bias `comp_bias` (b, n_kv, n_comp) float32, and `seen`, the number of tokens seen."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, comp_bias: torch.Tensor, seen: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values, self.is_initialized = keys, values, True
        self.comp_bias, self.seen = comp_bias, seen

    @property
    def n_comp(self) -> int:
        return int(self.comp_bias.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen += int(key_states.shape[-2])
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen, not entries held: HF derives positions and masks from it

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise AttnslimError("a compressed ATP cache cannot be cropped (assisted/speculative decoding); "
                            "generate without an assistant model")

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.comp_bias = self.comp_bias.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.comp_bias = self.comp_bias[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.comp_bias = self.comp_bias.index_select(0, beam_idx.to(self.comp_bias.device))


def cache_layer(cache: Any, idx: int) -> Any:
    """HF cache layer `idx`, or None when the cache has none (yet)."""
    if cache is None or idx >= len(cache.layers):
        return None
    return cache.layers[idx]


def install_cache_layer(cache: Any, idx: int, layer: Any) -> None:
    """Put `layer` at index `idx` of an HF cache, growing it with its default layer class as needed."""
    while len(cache.layers) <= idx:
        if cache.layer_class_to_replicate is None:
            raise AttnslimError(f"layer {idx}: the KV cache has only {len(cache.layers)} layers")
        cache.layers.append(cache.layer_class_to_replicate())
    cache.layers[idx] = layer


# Keywords every from_pretrained call of attnslim passes: attnslim never needs a directory's own code, so
# transformers must neither run it nor ask on the terminal whether to (a "y" there runs the directory's .py files).
SAFE_LOADING: dict[str, bool] = {"trust_remote_code": False}


def config_from_dict(model_type: str, values: dict[str, Any]) -> Any:
    """The transformers config of `model_type` built from a config.json dict, without consulting auto_map."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise AttnslimError(f"model_type {model_type!r} is not known to this transformers; a newer version may be "
                            "needed, or the directory is damaged")
    try:
        return CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as err:  # transformers' config validators raise several types (huggingface_hub's among them)
        problem = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
        raise AttnslimError(f"config.json is not a valid {model_type} configuration ({problem})") from err


def checkpoint_config(values: dict[str, Any], name_or_path: str) -> Any:
    """`AutoConfig.from_pretrained(directory, trust_remote_code=False)`'s config from the config.json dict already
    read (models/load.read_checkpoint): class by `model_type` (never auto_map), "mistral" with `layer_types` is
    "ministral", `name_or_path` the directory."""
    model_type = values.get("model_type")
    if not isinstance(model_type, str):
        raise AttnslimError(f"config.json has no model_type (got {model_type!r}); restore the model's own config.json")
    if model_type == "mistral" and "layer_types" in values:
        model_type = "ministral"
    config = config_from_dict(model_type, {**values, "model_type": model_type})
    config.name_or_path = name_or_path
    return config


LAST_LOGITS_ONLY: dict[str, int] = {"logits_to_keep": 1}  # forward(): logits at the last position only (prefill)


def last_logits(model: Any, n: int) -> dict[str, int]:
    """forward() keywords computing the logits of the last n positions only; {} (every position) for a model
    whose forward does not take them."""
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def logits_processors(*processors: Any) -> Any:
    """`processors` (callables (input_ids, scores) -> scores) as generate()'s `logits_processor` argument."""
    from transformers import LogitsProcessorList

    return LogitsProcessorList(processors)


MAX_POSITIONS = 1 << 24  # 16.8M tokens: above any released model's trained context (the longest claimed: 10M)


def check_positions(config: Any, tokens: int, what: str) -> None:
    """Refuse `tokens` positions beyond the model's `max_position_embeddings` (when the config has one)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > MAX_POSITIONS:
        raise AttnslimError(f"the config's max_position_embeddings = {limit} is no context a model was trained for "
                            f"(this check allows up to {MAX_POSITIONS}); the config.json is damaged or was edited: "
                            "restore the base model's value")
    if isinstance(limit, int) and tokens > limit:
        raise AttnslimError(f"{what} = {tokens} tokens exceeds the model's {limit} positions "
                            "(max_position_embeddings); use fewer tokens")


@contextmanager
def activation_checkpointing(model: Any) -> Iterator[None]:
    """transformers' own activation (gradient) checkpointing of `model`'s decoder layers inside the block, undone
    after (unless it was on before). Non-reentrant: a checkpointed layer whose inputs need no gradient (frozen
    layers below the first trained tensor) still passes gradients to the trained tensors inside it. transformers
    5.23 names it activation_checkpointing_*; gradient_checkpointing_* are its deprecated aliases."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise AttnslimError(f"{type(model).__name__} does not support activation checkpointing; train without it")
    before = model.is_activation_checkpointing
    if not before:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        if not before:
            model.activation_checkpointing_disable()


def input_device(model: Any) -> torch.device:
    """Where a model's input ids go: its input embedding's device (an offloaded model's first parameter may be on
    the meta device, or on another device than the embedding)."""
    return model.get_input_embeddings().weight.device


def install_output_head(model: Any, module: torch.nn.Module) -> None:
    """`module` as the output head, untied: the config (config.json, tie_weights()) and the cached tie map say so."""
    model.config.tie_word_embeddings = False
    model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    model.set_output_embeddings(module)
