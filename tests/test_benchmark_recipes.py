"""Every recipe a benchmark script builds is a valid recipe of today's methods.

The scripts run for hours and only on demand, so a method argument renamed or removed in `src/` would surface only
when somebody re-runs one (two scripts were found broken that way: mypy on benchmarks/ now catches signature drift,
and this catches argument drift, which mypy cannot see in plain-data recipes). Each recipe goes through
`recipe_from_dict` and `api.check_recipe`, which builds every step's method from its arguments, as `compress`
does before it loads a model."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from attnslim.api import check_recipe
from attnslim.recipe import recipe_from_dict

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SMOLLM2_SHAPES = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576),
                  "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536)}


@pytest.fixture(scope="module")
def script() -> Iterator[Any]:
    """Import a benchmarks/ script by name (they import each other by bare name, as when run from there)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield lambda name: importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def _check(recipes: dict[str, dict[str, Any]]) -> None:
    """Raises (AttnslimError naming the recipe, step and argument) where a recipe is not valid today."""
    assert recipes  # a builder that yields nothing would pass vacuously
    for recipe in recipes.values():
        check_recipe(recipe_from_dict(recipe))


def _named(steps_by_key: dict[str, list[dict[str, Any]]], cal: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"name": k, "calibration": cal, "steps": s} for k, s in steps_by_key.items()}


@pytest.mark.parametrize("kv", [0.5, 0.375, 0.25])
def test_mla_benchmark_recipes_are_valid(script: Any, kv: float) -> None:
    mla: ModuleType = script("mla")
    common: ModuleType = script("common")
    recipes = _named(mla.oneshot_variants(kv, True, (16, 32)), common.calibration())
    assert any(s["method"] == "transmla" for r in recipes.values() for s in r["steps"])  # the peer is built too
    heals = {f"{k}-heal40-{tag}": {**r, "name": f"{k}-heal40-{tag}", "heal": {**mla.HEAL, **change}}
             for k, r in recipes.items() for tag, change in mla.HEAL_ABLATIONS.items()}
    _check(recipes)
    _check(heals)


def test_latentllm_benchmark_recipes_are_valid(script: Any) -> None:
    latentllm: ModuleType = script("latentllm")
    common: ModuleType = script("common")
    steps = {**latentllm.attention_variants(0.8), **latentllm.precond_variants(), **latentllm.kv_variants(),
             **latentllm.whole_variants(SMOLLM2_SHAPES, 30, 134_515_008)}
    cal = common.calibration()
    heals = {k: {"name": k, "calibration": cal, "steps": s, "heal": heal}
             for k, (s, heal) in latentllm.heal_variants(steps, 40).items()}
    _check(_named(steps, cal))
    _check(heals)


def test_nbl_and_composed_benchmark_recipes_are_valid(script: Any) -> None:
    nbl: ModuleType = script("nbl")
    composed: ModuleType = script("composed")
    common: ModuleType = script("common")
    cal = common.calibration()
    args = [{"m": 6}, {"m": 6, **nbl.PAPER}] + [{"m": 6, "criterion": c} for c in nbl.SELECTIONS]
    _check({f"nbl-{i}": nbl.recipe(f"nbl-{i}", cal, nbl.nbl(a)) for i, a in enumerate(args)})
    _check(composed.variants(16))


@pytest.mark.parametrize("kv", [0.5, 0.375, 0.25, 0.15, 0.1])
def test_plan_benchmark_baselines_are_valid_and_remove_the_fewest_layers_under_the_budget(script: Any,
                                                                                         kv: float) -> None:
    plan: ModuleType = script("plan")
    layers, marker = 30, 1 / 1536  # SmolLM2: a KV-free layer keeps 1 of a dense layer's 1,536 bytes per token
    rows = {m: plan.baseline(m, kv, layers, marker) for m in ("mla", "transmla", "mla-local", "nbl", "drop")}
    _check({f"{m}-kv{kv:g}": row for m, row in rows.items()})
    removed = rows["nbl"]["steps"][0]["args"]["m"]
    assert removed == rows["drop"]["steps"][0]["args"]["count"]

    def kept(m: int) -> float:  # the KV fraction with m layers removed
        return (layers - m + m * marker) / layers

    assert kept(removed) <= kv < kept(removed - 1)


@pytest.mark.parametrize(("name", "argv"), [
    ("baselines", ["--only", "svd-attn-80,no-such-variant"]),
    ("mla", ["--groups", "oneshot", "--only", "mla-kv50, no-such-variant"]),
    ("nbl", ["--groups", "sweep,probe", "--m", "6", "--only", "nbl-paper-m6,drop-probe-layers-m6,no-such-variant"]),
    ("lisa", ["--only", "lisa-50,no-such-variant"]),
    ("composed", ["--only", "no-such-variant"]),
    ("summary_accuracy", ["--only", "no-such-variant"]),
    ("latentllm", ["--groups", "attn", "--only", "latentllm-80,no-such-variant"]),
])
def test_every_benchmark_refuses_an_unknown_only_key_before_any_model_loads(
        script: Any, monkeypatch: pytest.MonkeyPatch, name: str, argv: list[str]) -> None:
    # a misspelt or out-of-group --only key used to be skipped silently: hours later its row was simply missing
    import transformers

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model loaded before --only was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    module: ModuleType = script(name)
    if name == "summary_accuracy":  # the lm-eval task files are not what this test is about
        monkeypatch.setattr(module, "check_limit", lambda names, limit: {})
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit, match="does not define: no-such-variant; "):
        module.main()


def test_nbl_benchmark_accepts_every_key_its_groups_define(script: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # nbl.py names its rows while it runs (drops follow the layers a variant chose): its key list is built first
    import transformers

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loads: --only was accepted")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    keys = "nbl-similarity-m6,nbl-paper-m6,nbl-random-m6,drop-paper-layers-m6,nbl-seq-similarity-m6,nbl-probe-m6"
    monkeypatch.setattr(sys, "argv", ["nbl.py", "--groups", "sweep,probe", "--m", "6", "--only", keys])
    with pytest.raises(AssertionError, match="--only was accepted"):
        script("nbl").main()


def test_rope_stride_benchmark_variants_are_valid_mla_steps(script: Any) -> None:
    rope_stride: ModuleType = script("rope_stride")
    _check({label: {"name": label, "calibration": {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0},
                    "steps": [{"method": "mla", "layers": "all", "args": {"kv_ratio": 0.625, "rope_dims": 64,
                                                                          "rope_spread": True, "rope_fold": 1,
                                                                          **extra}}]}
            for label, extra in rope_stride.VARIANTS.items()})


def test_plan_benchmark_joins_a_plans_mla_layers_under_one_global_allocation_at_their_kv(script: Any) -> None:
    plan: ModuleType = script("plan")
    cal = {"source": "wiki", "windows": 32, "seq_len": 512, "seed": 0}
    recipe = {"name": "plan-kv0.25", "calibration": cal, "steps": [
        {"method": "mla", "layers": [0, 5], "args": {"kv_ratio": 0.125, "refit_o": True}},
        {"method": "nbl", "layers": [8, 9], "args": {"criterion": "given", "sequential": True}},
        {"method": "mla", "layers": [2, 3, 4], "args": {"kv_ratio": 0.5, "refit_o": True}}]}
    joined = plan.with_local(plan.with_global(recipe))
    _check({joined["name"]: joined})
    mla = [s for s in joined["steps"] if s["method"] == "mla"]
    assert len(mla) == 1 and mla[0]["layers"] == [0, 2, 3, 4, 5]
    assert mla[0]["args"]["alloc"] == "global" and mla[0]["args"]["local_steps"] == 96
    assert mla[0]["args"]["kv_ratio"] == pytest.approx((2 * 0.125 + 3 * 0.5) / 5)  # the plan's mla KV, re-spread
    assert [s["method"] for s in joined["steps"]] == ["mla", "nbl"]  # the nbl step kept, after the first mla step's
    recipe["steps"][2]["args"]["refit_o"] = False
    with pytest.raises(SystemExit, match="differ beyond kv_ratio"):
        plan.with_global(recipe)


def test_calibration_source_rows_change_only_the_source_windows_and_heal(script: Any) -> None:
    from attnslim.recipe import load_recipe, recipe_to_dict

    calib = script("calib_source")
    mla = recipe_to_dict(load_recipe("mla"))
    rows = {s: calib.with_source(mla, s, heal=False, one_shot=True, windows=8) for s in ("wiki", "self+wiki")}
    _check(rows)
    for source, row in rows.items():
        assert row["name"] == f"mla-oneshot-w8-calib{source}" and "heal" not in row  # the 1.5B rows' names
        assert row["calibration"] == {**mla["calibration"], "source": source, "windows": 8}
        assert row["steps"] == mla["steps"]
    healed = calib.with_source(mla, "self", heal=True)
    assert healed["heal"]["source"] == "self" and healed["calibration"]["windows"] == mla["calibration"]["windows"]
