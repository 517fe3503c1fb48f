"""benchmarks/common.py's resume rule: a stored row is reused only while the defaults it ran under still hold."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from attnslim.methods.mla import MLA
from attnslim.recipe import Recipe, fingerprint, recipe_from_dict
from attnslim.registry import METHODS

COMMON = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"


def _common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_common", COMMON)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe(args: dict[str, object]) -> Recipe:
    return recipe_from_dict({"name": "r", "calibration": {"source": "tiny", "windows": 4, "seq_len": 32},
                             "steps": [{"method": "mla", "layers": "all", "args": args}]})


def test_resolved_fingerprint_sees_defaults_the_recipe_fingerprint_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = _common().resolved_fingerprint
    short, spelled = _recipe({"kv_ratio": 0.5}), _recipe({"kv_ratio": 0.5, "rope_select": "query"})
    assert fingerprint(short) != fingerprint(spelled)  # the same run, written two ways
    assert resolved(short) == resolved(spelled)
    before = resolved(short)

    @dataclass(frozen=True)
    class ChangedDefault(MLA):
        rope_select: str = "pca"

    monkeypatch.setitem(METHODS, "mla", ChangedDefault)
    assert fingerprint(_recipe({"kv_ratio": 0.5})) == fingerprint(short)  # blind to the change
    assert resolved(_recipe({"kv_ratio": 0.5})) != before


def test_harness_refuses_rows_scored_on_other_windows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A results file whose stored rows were scored on other windows (e.g. before windows began with <bos>) is
    refused, so no ratio mixes the two; rows scored on the same windows are extended."""
    import json

    from helpers import BosTokenizer, ByteTokenizer

    common = _common()
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    kw = {"sources": ("tiny",), "tokens": 128, "seq_len": 64}
    first = common.Harness("h", **kw)
    text = first.windows(ByteTokenizer())["tiny"]
    first.data["variants"]["row"] = {"ppl": {"tiny": 1.0}}
    (tmp_path / "h.json").write_text(json.dumps(first.data))
    assert common.Harness("h", **kw).windows(ByteTokenizer())["tiny"].description == text.description
    with pytest.raises(SystemExit, match="other windows.*new --name"):
        common.Harness("h", **kw).windows(BosTokenizer())
    empty = {**first.data, "variants": {}}
    (tmp_path / "h.json").write_text(json.dumps(empty))  # no rows yet: the new windows are simply recorded
    assert "<bos>" in common.Harness("h", **kw).windows(BosTokenizer())["tiny"].description


def test_two_harnesses_on_one_results_file_keep_each_others_rows(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Two benchmark processes writing one results file each save their own copy; a save keeps the rows the other
    recorded since this one read the file, and a row this process measured again replaces the stored one."""
    import json

    common = _common()
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    kw = {"sources": ("tiny",), "tokens": 128, "seq_len": 64}
    first, second = common.Harness("h", **kw), common.Harness("h", **kw)  # both read the file before either saved
    dense = {"ppl": {"tiny": 2.0}, "params": {"attention": 4, "mlp": 4, "total": 8}}
    measured = {"ppl": {"tiny": 3.0}, "params": {"attention": 2, "mlp": 4, "total": 6}}
    first.record("a", dict(measured), dense)
    second.record("b", dict(measured), dense)
    assert set(json.loads((tmp_path / "h.json").read_text())["variants"]) == {"a", "b"}
    second.record("a", {**measured, "ppl": {"tiny": 4.0}}, dense)  # measured again by this process: its row wins
    assert json.loads((tmp_path / "h.json").read_text())["variants"]["a"]["ppl_ratio"]["tiny"] == 2.0
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]  # no temporary file left behind


def test_harness_row_keeps_the_head_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A recipe with a `head:` section stores the head's record (its plan: ranks, tied or not) in the row, as rows
    keep their heal record; a recipe without one stores none."""
    from conftest import tiny_llama
    from helpers import ByteTokenizer

    common = _common()
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "load_on_device", lambda name: (tiny_llama(), ByteTokenizer()))
    h = common.Harness("h", sources=("tiny",), tokens=128, seq_len=64)
    steps = [{"method": "latentllm", "layers": "all", "args": {"ratio": 0.8}}]
    cal = {"source": "tiny", "windows": 4, "seq_len": 32}
    row = h.run("head", {"name": "head", "calibration": cal, "steps": steps, "head": {"ratio": 0.5, "untie": True}})
    assert row["head"]["plan"]["tied"] is True and row["head"]["ratio"] == 0.5
    assert "head" not in h.run("plain", {"name": "plain", "calibration": cal, "steps": steps})


def test_atp_results_keep_their_serving_rows_when_another_group_runs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/atp.py's Store replaced the stored serving rows whenever the run's serving arguments differed from
    theirs, even in a run that measures no serving (a `--groups speed` run with the default --n 8 would have erased
    atp-gemma3.json's n=4 rows). Only a serving run replaces them now."""
    import argparse
    import json

    monkeypatch.syspath_prepend(str(COMMON.parent))
    spec = importlib.util.spec_from_file_location("benchmarks_atp", COMMON.parent / "atp.py")
    assert spec is not None and spec.loader is not None
    atp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atp)
    monkeypatch.setattr(atp, "RESULTS", tmp_path)
    stored = {"setting": {"context": 1024, "continuation": 256, "n": 4, "window": 32},
              "dense": {"ppl": {"wiki": 7.0}}, "variants": {"hybrid r=1/4": {"ppl_ratio": {"wiki": 1.09}}}}
    (tmp_path / "atp-x.json").write_text(json.dumps(stored))
    args = argparse.Namespace(context=1024, continuation=256, n=8, window=32, sources=["wiki"], model="m")
    kept = atp.Store("atp-x", args, serving=False)
    assert kept.data["variants"] == stored["variants"] and kept.data["setting"]["n"] == 4
    assert kept.data["eval"]["tokens"] == 4 * (1024 + 256)  # the stored rows' evaluation, not the arguments'
    fresh = atp.Store("atp-x", args, serving=True)
    assert fresh.data["variants"] == {} and fresh.data["setting"]["n"] == 8


def test_only_refuses_a_variant_the_selected_groups_do_not_define() -> None:
    # the 1.5B LatentLLM run asked for latentllm-90 (group kv) under --groups attn,precond and silently skipped it
    selected = _common().selected
    known = ["latentllm-80", "svdllm-attn-80", "latentllm-l2-80"]
    assert selected("latentllm-80, svdllm-attn-80", known, "attn") == {"latentllm-80", "svdllm-attn-80"}
    assert selected("", known, "attn") == set(known)
    with pytest.raises(SystemExit, match="--groups attn,precond does not define: latentllm-90"):
        selected("latentllm-80,latentllm-90", known, "attn,precond")
