"""Test helpers: a tokenizer stand-in for tiny models and a one-step recipe builder."""

from __future__ import annotations

from typing import Any

from attnslim.recipe import Recipe, recipe_from_dict


class ByteTokenizer:
    """Maps characters to ids < vocab: enough for calibration windows on tiny random models."""

    def __init__(self, vocab: int = 128) -> None:
        self.vocab = vocab

    def __call__(self, text: str, **kw: Any) -> dict[str, list[int]]:
        return {"input_ids": [(ord(c) * 7) % self.vocab for c in text[:20000]]}

    def save_pretrained(self, directory: Any) -> None:
        pass


class WordTokenizer(ByteTokenizer):
    """ByteTokenizer plus decode: every third id is a whole word (" wordX"), the rest are fragments (enough for
    zero-shot items)."""

    def decode(self, ids: list[int]) -> str:
        (i,) = ids
        return f" word{chr(97 + i % 26)}" if i % 3 == 0 else "x1"


class BosTokenizer(WordTokenizer):
    """Starts sequences with BOS (id 200, outside the text's ids) when asked for special tokens, as Gemma's
    tokenizer does while its add_bos_token flag says False."""

    bos_token_id = 200

    def __call__(self, text: str, add_special_tokens: bool = True, **kw: Any) -> dict[str, list[int]]:
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": [200, *ids] if add_special_tokens else ids}


class SavingTokenizer(ByteTokenizer):
    """A ByteTokenizer that writes real (character-level) tokenizer files, so saved directories load."""

    def save_pretrained(self, directory):
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {chr(65 + i): i for i in range(26)} | {"<unk>": 26}
        word = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        word.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
        fast = PreTrainedTokenizerFast(tokenizer_object=word)
        fast.save_pretrained(directory)


def reloaded_with_both_loaders(model: Any, report: dict[str, Any], directory: Any, ids: Any) -> Any:
    """Save `model`, load it with attnslim.io.load and with transformers' trust_remote_code entry, assert both give
    exactly the logits of `model` on `ids`, and return the attnslim-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM

    from attnslim.io import load, save

    ref = model(input_ids=ids).logits
    out = save(model, SavingTokenizer(), directory, report)
    loaded, _ = load(out)
    assert torch.equal(loaded(input_ids=ids).logits, ref)
    auto = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert torch.equal(auto(input_ids=ids).logits, ref)
    return loaded


def install_sharing(model: Any, method: Any, layers: list[int]) -> Any:
    """Plan + convert a lisa or ds `method` on `layers` in place (neither needs calibration statistics: lisa starts
    from direct sharing with a compensator initialised from the weights); returns the model's adapter."""
    from attnslim.adapters import get_adapter

    adapter = get_adapter(model)
    for i, entry in method.plan(adapter, layers, {}).layers.items():
        method.convert(adapter, i, entry, None)
    return adapter


def convert_atp(model: Any, **args: Any) -> Any:
    """Install atp on every full-attention layer (no calibration pass needed: atp has no statistics)."""
    from attnslim.adapters import get_adapter
    from attnslim.methods.atp import Atp

    method, adapter = Atp(**args), get_adapter(model)
    layers = [i for i, kind in enumerate(adapter.layer_types()) if kind == "full_attention"] or [0]
    for i, entry in method.plan(adapter, layers, {}).layers.items():
        method.convert(adapter, i, entry, None)
    return model


def one_step(method: str, args: dict[str, Any], layers: Any = "all", windows: int = 4, seq_len: int = 32) -> Recipe:
    return recipe_from_dict({
        "name": f"test-{method}",
        "calibration": {"source": "tiny", "windows": windows, "seq_len": seq_len, "seed": 0, "batch_size": 2},
        "steps": [{"method": method, "layers": layers, "args": args}],
    })


def assert_cache_kinds_match(model: Any, ids: Any, mask: Any = None, steps: int = 3) -> None:
    """A prefill of ids (b, t) (left padding where mask is 0), then `steps` greedy steps, decoded with every
    cache kind of _compat.new_cache give the logits of the default dynamic cache: HF's static cache
    (generate's cache_implementation="static": one preallocated buffer per layer, returned whole with its
    unfilled rows, HF's mask spanning it) and the reserved-rows cache (appends in place)."""
    import torch

    from attnslim import _compat

    logits = {}
    for kind in _compat.CACHE_KINDS:
        cache = _compat.new_cache(model.config, kind, ids.shape[1] + steps)
        keep = torch.ones_like(ids) if mask is None else mask
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=keep, past_key_values=cache, use_cache=True)
            rows = [out.logits[:, -1]]
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                keep = torch.cat([keep, torch.ones_like(token)], dim=1)
                out = model(input_ids=token, attention_mask=keep, past_key_values=cache, use_cache=True)
                rows.append(out.logits[:, -1])
        logits[kind] = torch.stack(rows)  # (steps + 1, b, vocab)
    for kind in _compat.CACHE_KINDS:
        gap = (logits[kind] - logits["dynamic"]).abs().max() / logits["dynamic"].abs().max()
        assert gap < 1e-5, (kind, gap)


def attention_inputs_and_ppl(model: Any, layers: list[int], windows: Any) -> tuple[dict[int, Any], float]:
    """({layer: its attention input on `windows`}, the model's perplexity on them), from one evaluation pass: what
    the real tests compare a converted layer's logit error and a converted model's perplexity against."""
    from contextlib import ExitStack

    import torch

    from attnslim.adapters import get_adapter
    from attnslim.calib.hooks import capture_sites
    from attnslim.eval import perplexity

    adapter = get_adapter(model)
    seen: dict[int, list[Any]] = {i: [] for i in layers}  # perplexity runs one window at a time: keep them all
    with torch.no_grad(), ExitStack() as stack:
        for i in layers:
            stack.enter_context(capture_sites(adapter, i, {"attn_in"}, lambda _s, x, i=i: seen[i].append(x)))
        ppl = perplexity(model, windows, progress=False).ppl
    return {i: torch.cat(xs) for i, xs in seen.items()}, ppl  # {layer: (windows, seq_len, hidden)}
