"""Recipe dataclasses, layer selectors, YAML I/O, overrides and fingerprints (pure, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from attnslim.errors import AttnslimError
from attnslim.recipe import (
    RECIPES_DIR,
    Calibration,
    Recipe,
    Step,
    apply_overrides,
    dump_recipe,
    fingerprint,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    resolve_layers,
    rest_layers,
)

PACKAGED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
import attnslim.methods  # noqa: E402,F401  (registers every method)
from attnslim.registry import METHODS  # noqa: E402


def two_step() -> Recipe:
    return Recipe(
        name="mix",
        calibration=Calibration(source="c4", windows=8, seq_len=128, seed=3, batch_size=2),
        steps=(Step("svdllm", "0:4", {"ratio": 0.5}), Step("nbl", [6, 7], {"count": 2})),
        description="two methods on disjoint layers",
    )


def test_packaged_recipes_present_and_load():
    assert {"svd", "asvd", "svdllm", "drop", "default"} <= set(PACKAGED)
    for name in PACKAGED:
        r = load_recipe(name)
        assert r.steps and r.calibration.windows >= 1
        assert load_recipe(RECIPES_DIR / f"{name}.yaml") == r  # a path works too
        first = [5, 6, 7, 8, 9, 10, 11, 12, 14, 17, 22, 25, 26, 28, 29] if name == "atp-paper" else list(range(30))
        assert r.resolve(30, METHODS)[0][1] == first
    default = load_recipe("default")
    assert default.name == "default" and [s.method for s in default.steps] == ["mla"]
    assert default.steps[0].args == {"kv_ratio": 0.5, "rope_select": "query", "kv_weight": "attention"}
    assert default.heal is not None and default.heal["steps"] == 40  # what the demo's ten minutes allow
    assert default.heal["source"] == "wiki+c4+tiny"  # heal-default.json: tiny acc -2.5 pts (wiki+c4: -4.3)
    assert default.heal["lr"] == 1e-4  # heal-default.json: lr 3e-4 drops wiki_nextsent past the 3-point target
    assert default.heal["precision"] == "auto"  # heal-precision.json: the same quality, two thirds of the time
    previous = load_recipe("latentllm-kv50")  # the default before MLA, kept under its own name
    float32_heal = {k: v for k, v in default.heal.items() if k != "precision"}
    assert [s.method for s in previous.steps] == ["latentllm"] and previous.heal == float32_heal
    assert load_recipe("asvd").steps[0].args == {"ratio": 0.8, "alpha": 0.5, "linears": ["q", "k", "v", "o"]}
    assert load_recipe("drop").steps[0].args == {"count": 6, "select": "similarity"}


@pytest.mark.parametrize("name", PACKAGED)
def test_yaml_round_trip(name, tmp_path):
    r = load_recipe(name)
    out = tmp_path / "r.yaml"
    dump_recipe(r, out)
    again = load_recipe(out)
    assert again == r
    dump_recipe(again, tmp_path / "r2.yaml")
    assert (tmp_path / "r2.yaml").read_text() == out.read_text()
    assert yaml.safe_load(out.read_text()) == recipe_to_dict(r)


def test_dict_round_trip_keeps_selectors(tmp_path):
    r = two_step()
    assert recipe_from_dict(recipe_to_dict(r)) == r
    dump_recipe(r, tmp_path / "mix.yaml")
    assert load_recipe(str(tmp_path / "mix.yaml")) == r
    assert recipe_to_dict(r)["steps"][1]["layers"] == [6, 7]


def test_unquoted_slice_in_yaml_is_not_base60(tmp_path):
    # YAML 1.1 reads 4:28 as the base-60 int 268; recipes must keep it a slice
    p = tmp_path / "s.yaml"
    p.write_text("name: s\nsteps:\n  - method: svd\n    layers: 4:28\n")
    r = load_recipe(p)
    assert r.steps[0].layers == "4:28"
    assert r.steps[0].args == {} and r.calibration == Calibration()
    assert r.resolve(32, METHODS)[0][1] == list(range(4, 28))


@pytest.mark.parametrize(
    ("selector", "n", "expected"),
    [
        ("all", 5, [0, 1, 2, 3, 4]),
        ("4:28", 32, list(range(4, 28))),
        ("-6:", 32, list(range(26, 32))),
        (":3", 8, [0, 1, 2]),
        ("2:-2", 8, [2, 3, 4, 5]),
        ("0:8", 8, list(range(8))),
        ([0, 3, 7], 8, [0, 3, 7]),
        ([7, 3, 3, -8], 8, [0, 3, 7]),
        ((1, 2), 4, [1, 2]),
        (5, 8, [5]),
        (-1, 8, [7]),
    ],
)
def test_resolve_layers(selector, n, expected):
    assert resolve_layers(selector, n) == expected


@pytest.mark.parametrize(
    ("selector", "n", "why"),
    [
        ("4:28", 16, "out of range"),
        ("-20:", 16, "out of range"),
        ([0, 16], 16, "out of range"),
        (16, 16, "out of range"),
        (-17, 16, "out of range"),
        ("5:5", 16, "selects no layers"),
        ("8:2", 16, "selects no layers"),
        ([], 16, "selects no layers"),
    ],
)
def test_resolve_layers_errors(selector, n, why):
    with pytest.raises(AttnslimError) as e:
        resolve_layers(selector, n)
    msg = str(e.value)
    assert why in msg and repr(selector) in msg and f"n_layers={n}" in msg and '"all"' in msg


@pytest.mark.parametrize("selector", ["everything", "1-3", "1:2:3", 2.5, True, [0, "1"], {"a": 1}])
def test_bad_selector_form(selector):
    with pytest.raises(AttnslimError, match="not a layer selector; valid forms"):
        resolve_layers(selector, 8)
    with pytest.raises(AttnslimError, match="not a layer selector"):
        Step("svd", selector)


def test_resolve_steps():
    resolved = two_step().resolve(8, METHODS)
    assert [(s.method, layers) for s, layers in resolved] == [("svdllm", [0, 1, 2, 3]), ("nbl", [6, 7])]


def test_rest_is_resolved_at_run_time_and_only_as_the_last_of_several_steps():
    r = Recipe("nbl+rest", steps=(Step("nbl", "all", {"m": 2}), Step("svdllm", "rest")))
    assert [layers for _, layers in r.resolve(8, METHODS)] == [list(range(8)), None]
    assert rest_layers(8, {0, 5}) == [1, 2, 3, 4, 6, 7]
    with pytest.raises(AttnslimError, match="converted all 8 layers"):
        rest_layers(8, set(range(8)))
    for steps in [(Step("svdllm", "rest"),), (Step("svdllm", "rest"), Step("nbl", [1]))]:
        with pytest.raises(AttnslimError, match='"rest" is only valid for the last step'):
            Recipe("bad", steps=steps).resolve(8, METHODS)


def test_overlap_is_an_error():
    r = Recipe("clash", steps=(Step("svd", "0:6"), Step("asvd", [5, 6, 7])))
    with pytest.raises(AttnslimError) as e:
        r.resolve(8, METHODS)
    msg = str(e.value)
    assert "step 0 (svd" in msg and "step 1 (asvd" in msg and "[5]" in msg and "disjoint" in msg


def test_unknown_method_lists_valid():
    r = Recipe("u", steps=(Step("warp"),))
    with pytest.raises(AttnslimError) as e:
        r.resolve(8, METHODS)
    msg = str(e.value)
    assert "'warp'" in msg and ", ".join(sorted(METHODS)) in msg


def test_out_of_range_step_names_selector():
    with pytest.raises(AttnslimError, match=r"'4:28' is out of range for a model with n_layers=16"):
        Recipe("big", steps=(Step("svd", "4:28"),)).resolve(16, METHODS)


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (lambda d: d.update(extra=1), ["unknown key(s) ['extra']", "valid keys: name, description"]),
        (lambda d: d["calibration"].update(window=4), ["calibration", "['window']", "windows", "batch_size"]),
        (lambda d: d["steps"][0].update(ratio=0.5), ["steps[0]", "['ratio']", "method, layers, args"]),
        (lambda d: d.pop("steps"), ["missing required key(s) ['steps']"]),
        (lambda d: d["steps"][0].pop("method"), ["steps[0] is missing required key(s) ['method']"]),
    ],
)
def test_unknown_and_missing_keys(mutate, fragments):
    d = recipe_to_dict(load_recipe("svdllm"))
    mutate(d)
    with pytest.raises(AttnslimError) as e:
        recipe_from_dict(d)
    for f in fragments:
        assert f in str(e.value)


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (lambda d: d["calibration"].update(windows="32"), ["calibration.windows must be an int", "str '32'"]),
        (lambda d: d["calibration"].update(seq_len=1), ["calibration.seq_len must be in [2, 32768]", "1"]),
        (lambda d: d["calibration"].update(windows=0), ["calibration.windows must be >= 1"]),
        (lambda d: d["calibration"].update(batch_size=True), ["calibration.batch_size must be an int"]),
        (lambda d: d["calibration"].update(source="wiki2"), ["calibration.source", "'wiki2'", "file:PATH"]),
        (lambda d: d["calibration"].update(source=3), ["calibration.source must be one of", "got 3"]),
        (lambda d: d["calibration"].update(source="wiki+"), ["a mixture such as 'wiki+c4'", "'wiki+'"]),
        (lambda d: d.update(name=5), ["name must be a non-empty str", "int 5"]),
        (lambda d: d.update(steps={"method": "svd"}), ["steps must be a list"]),
        (lambda d: d.update(steps=[]), ["has no steps"]),
        (lambda d: d.update(calibration=[1]), ["calibration must be a mapping"]),
        (lambda d: d["steps"][0].update(method=7), ["steps[0]", "method must be a non-empty str"]),
        (lambda d: d["steps"][0].update(args=[1]), ["steps[0]", "args of 'svdllm'", "mapping of hyper"]),
        (lambda d: d["steps"][0].update(layers=2.5), ["steps[0]", "layers = 2.5 is not a layer selector"]),
        (lambda d: d["steps"][0].update(layers={-6: None}), ["quote slices in YAML"]),
    ],
)
def test_wrong_types(mutate, fragments):
    d = recipe_to_dict(load_recipe("svdllm"))
    mutate(d)
    with pytest.raises(AttnslimError) as e:
        recipe_from_dict(d)
    for f in fragments:
        assert f in str(e.value)


def test_args_must_be_plain_data_and_are_copied():
    with pytest.raises(AttnslimError, match="args of 'svd' must be str/number/bool/list/dict"):
        Step("svd", args={"x": object()})
    args = {"ratio": 0.5, "linears": ("q", "k")}
    s = Step("svd", args=args)
    args["ratio"] = 0.1
    assert s.args == {"ratio": 0.5, "linears": ["q", "k"]}


def test_calibration_file_source_and_defaults():
    assert Calibration() == Calibration(source="wiki", windows=32, seq_len=512, seed=0, batch_size=4)
    assert Calibration(source="file:/tmp/x.txt").source == "file:/tmp/x.txt"
    assert Calibration(source="wiki+c4+tiny").source == "wiki+c4+tiny"
    with pytest.raises(AttnslimError, match="file:PATH"):
        Calibration(source="file:")


def test_load_errors_name_file_and_choices(tmp_path):
    with pytest.raises(AttnslimError) as e:
        load_recipe("nope")
    assert "'nope'" in str(e.value) and "svdllm" in str(e.value)
    with pytest.raises(AttnslimError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nsteps:\n  - method: svd\n    layers: -6:\n")
    with pytest.raises(AttnslimError, match=str(bad)):
        load_recipe(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: t\ncalibration: {windos: 3}\nsteps: [{method: svd}]\n")
    with pytest.raises(AttnslimError) as e:
        load_recipe(typo)
    assert str(typo) in str(e.value) and "['windos']" in str(e.value) and "windows" in str(e.value)


def test_overrides():
    r = load_recipe("svdllm")
    out = apply_overrides(
        r,
        [
            "calibration.windows=64",
            "calibration.source=file:/data/my.txt",
            "steps.0.args.ratio=0.5",
            "steps.0.args.damp=0.01",
            "steps.0.layers=4:28",
            "name=x",
            "description=a b c",
        ],
    )
    assert out.calibration.windows == 64 and out.calibration.source == "file:/data/my.txt"
    assert out.steps[0].args == {"ratio": 0.5, "linears": ["q", "k", "v", "o"], "damp": 0.01}
    assert out.steps[0].layers == "4:28" and out.name == "x" and out.description == "a b c"
    assert r.steps[0].args["ratio"] == 0.8 and r.name == "svdllm-attn-80"  # original untouched
    assert apply_overrides(r, ["steps.0.layers=-6:"]).steps[0].layers == "-6:"
    assert apply_overrides(r, ["steps.0.layers=[0, 3, 7]"]).steps[0].layers == (0, 3, 7)
    assert apply_overrides(r, ["steps.0.layers=5"]).steps[0].layers == 5
    assert apply_overrides(r, ["steps.-1.args.linears=[q, k]"]).steps[0].args["linears"] == ["q", "k"]
    assert apply_overrides(r, []) == r


@pytest.mark.parametrize(
    ("item", "fragments"),
    [
        ("calibration.window=64", ["'calibration.window'", "no 'window' under calibration", "windows"]),
        ("steps.3.args.ratio=0.5", ["'steps.3.args.ratio'", "no '3' under steps", "indices 0..0"]),
        ("steps.0.argz.ratio=1", ["no 'argz' under steps.0", "method, layers, args"]),
        ("steps.0.args.a.b=1", ["no 'a' under steps.0.args"]),
        ("name.first=x", ["no 'first' under name", "it is a value"]),
        ("foo=1", ["no 'foo' under the top level", "name, description, calibration, steps"]),
        ("calibration.windows", ["must look like key=value"]),
        ("calibration.windows=many", ["calibration.windows must be an int", "'many'"]),
        ("steps.0.layers=1:2:3", ["not a layer selector"]),
    ],
)
def test_override_errors(item, fragments):
    with pytest.raises(AttnslimError) as e:
        apply_overrides(load_recipe("svdllm"), [item])
    for f in fragments:
        assert f in str(e.value)


def test_fingerprint_stable_and_content_sensitive(tmp_path: Path):
    r = load_recipe("svdllm")
    fp = fingerprint(r)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fingerprint(load_recipe("svdllm")) == fp
    dump_recipe(r, tmp_path / "r.yaml")
    assert fingerprint(load_recipe(tmp_path / "r.yaml")) == fp
    # key order of args does not matter, content does
    step = Step("svdllm", "all", {"linears": ["q", "k", "v", "o"], "ratio": 0.8})
    reordered = Recipe(r.name, r.calibration, (step,), r.description)
    assert fingerprint(reordered) == fp
    for item in ["steps.0.args.ratio=0.7", "calibration.seed=1", "steps.0.layers=0:4", "name=y"]:
        assert fingerprint(apply_overrides(r, [item])) != fp
