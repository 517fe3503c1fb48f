"""`calibration: {source: self}`: windows the dense model samples itself (data/generated.py)."""

from __future__ import annotations

import pytest
import torch

from attnslim.api import compress
from attnslim.data import calib_windows
from attnslim.errors import AttnslimError
from attnslim.recipe import recipe_from_dict, recipe_to_dict
from conftest import tiny_llama
from helpers import BosTokenizer, ByteTokenizer, one_step


class _EosTokenizer(ByteTokenizer):
    eos_token_id = 3


def test_windows_are_sampled_full_length_from_the_start_token_and_reproducible() -> None:
    model, tok = tiny_llama(vocab_size=256), BosTokenizer()
    a = calib_windows("self", tok, 5, 12, seed=1, model=model)
    b = calib_windows("self", tok, 5, 12, seed=1, model=model)
    c = calib_windows("self", tok, 5, 12, seed=2, model=model)
    assert a.ids.shape == (5, 12) and torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert (a.ids[:, 0] == 200).all() and a.ids[:, 1:].lt(256).all() and a.ids[:, 1:].unique().numel() > 20
    assert "sampled from the dense model" in a.description
    # the global generator is left as it was
    torch.manual_seed(0)
    x = torch.rand(3)
    torch.manual_seed(0)
    calib_windows("self", tok, 2, 8, seed=5, model=model)
    assert torch.equal(torch.rand(3), x)


def test_end_of_text_is_suppressed_and_starts_windows_without_bos() -> None:
    model = tiny_llama()
    with torch.no_grad():  # make end-of-text (id 3) the model's favourite token
        model.lm_head.weight[3] *= 0
        model.lm_head.weight[3] += 50 * model.model.norm.weight.sign()
    ids = calib_windows("self", _EosTokenizer(), 4, 16, seed=0, model=model).ids
    assert (ids[:, 0] == 3).all() and not (ids[:, 1:] == 3).any()


def test_a_mixture_alternates_sampled_and_text_windows() -> None:
    model, tok = tiny_llama(vocab_size=256), BosTokenizer()
    mixed = calib_windows("self+wiki", tok, 4, 16, seed=0, model=model).ids
    text = calib_windows("wiki", tok, 2, 16, seed=0).ids
    sampled = calib_windows("self", tok, 2, 16, seed=0, model=model).ids
    assert torch.equal(mixed[1::2], text) and torch.equal(mixed[0::2], sampled)


def test_compress_calibrates_on_sampled_text_and_records_it() -> None:
    model, tok = tiny_llama(vocab_size=256), BosTokenizer()
    recipe = one_step("mla", {"kv_ratio": 0.5})
    recipe = recipe_from_dict({**recipe_to_dict(recipe), "calibration": {"source": "self", "windows": 4,
                                                                          "seq_len": 32}})
    report = compress(model, tok, recipe, progress=False)
    assert "sampled from the dense model" in str(report.to_json()["calibration"])


def test_refusals_name_the_fix() -> None:
    with pytest.raises(AttnslimError, match="samples the dense model, which this command does not load"):
        calib_windows("self", BosTokenizer(), 2, 8)
    with pytest.raises(AttnslimError, match="neither"):
        calib_windows("self", ByteTokenizer(), 2, 8, model=tiny_llama())
    with pytest.raises(AttnslimError, match="at most 4,096 of them"):
        calib_windows("self", BosTokenizer(), 10_000, 8, model=tiny_llama(vocab_size=256))
    with pytest.raises(AttnslimError, match="must be one of"):  # evaluation never reads sampled text
        from attnslim.data.sources import check_source

        check_source("--data", "self")
