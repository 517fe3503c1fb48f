"""The planner on tiny random models: exact costs, a planted linear layer, mixed plans, refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.bench import kv_bytes_per_token
from attnslim.bench.flops import decode_bytes_per_token
from attnslim.cli import main as cli_main
from attnslim.errors import AttnslimError
from attnslim.planner.assemble import plan_recipe
from attnslim.planner.candidates import candidate_set
from attnslim.planner.costs import resources
from attnslim.planner.run import PlanConfig, plan_model
from attnslim.recipe import Calibration, recipe_from_dict, recipe_to_dict
from conftest import tiny_llama, tiny_qwen2
from helpers import ByteTokenizer, reloaded_with_both_loaders

pytestmark = pytest.mark.usefixtures("one_thread")
CAL = Calibration(source="tiny", windows=8, seq_len=32, seed=0, batch_size=4)


def _config(**kw: object) -> PlanConfig:
    base: dict[str, object] = dict(calibration=CAL, score_windows=2, score_seq_len=32, refine_windows=2,
                                   ladder=(0.25, 0.5), mla_args={}, rounds=2, tries=3)
    return PlanConfig(**{**base, **kw})  # type: ignore[arg-type]


def _by_label(**kw: object) -> dict[str, object]:
    return {c.label: c for c in candidate_set(**kw)}  # type: ignore[arg-type]


def test_mixed_plan_costs_are_what_the_cache_holds_and_it_saves_and_loads(tmp_path: object) -> None:
    model = tiny_llama(num_hidden_layers=5)
    c = _by_label(mla_args={})
    choice = [c["mla@0.5"], c["keep"], c["ds"], c["nbl"], c["drop"]]
    adapter = get_adapter(model)
    predicted = [resources(adapter, i, cand, 64) for i, cand in enumerate(choice)]  # type: ignore[arg-type]
    dense = [resources(adapter, i, c["keep"], 64) for i in range(5)]  # type: ignore[arg-type]
    dense_decode = decode_bytes_per_token(model, 64, [r.kv_bytes for r in dense])["total"]
    recipe, methods = plan_recipe(choice, "mixed", "", CAL)  # type: ignore[arg-type]
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    assert [(s.method, s.layers) for s in recipe.steps] == [("mla", (0,)), ("nbl", (3,)), ("drop", (4,)), ("ds", (2,))]
    report = compress(model, ByteTokenizer(), recipe, progress=False, methods=methods)
    measured = kv_bytes_per_token(model)["per_layer"]
    assert measured == [r.kv_bytes for r in predicted]
    assert report.kv_bytes_per_token_after == sum(r.kv_bytes for r in predicted)
    decode = decode_bytes_per_token(model, 64, measured)["total"]
    assert decode == dense_decode - sum(r.decode_bytes for r in dense) + sum(r.decode_bytes for r in predicted)
    attention = [sum(p.numel() for p in adapter.attention(i).parameters()) for i in range(5)]
    assert [attention[0], attention[2], attention[3], attention[4]] == [predicted[i].params for i in (0, 2, 3, 4)]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    reloaded_with_both_loaders(model, report.to_json(), tmp_path / "out", ids)  # type: ignore[operator]


def test_planted_affine_layer_is_linearised() -> None:
    """Layer 1's values are a constant (W_v = 0, b_v ≠ 0): its attention output is W_o b_v whatever the input,
    an affine map NBL fits exactly while drop loses it. Under a KV budget that needs one layer's cache gone, the
    plan linearises that layer and no other."""
    model = tiny_qwen2()
    adapter = get_adapter(model)
    with torch.no_grad():
        attn = adapter.attention(1)
        attn.v_proj.weight.zero_()
        attn.v_proj.bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    result = plan_model(model, ByteTokenizer(), _config(kv=0.7, kinds=("keep", "mla", "nbl", "drop"),
                                                        ladder=(0.5,)), progress=False)
    choices = [row["choice"] for row in result.report["layers"]]
    assert choices[1] == "nbl" and choices.count("nbl") == 1
    options = result.report["options"]["1"]
    assert options["nbl"]["kl"] < 1e-3 * options["drop"]["kl"]
    assert result.report["used"]["kv"] <= 0.7


def test_plan_meets_the_budget_exactly_and_reports_why() -> None:
    model = tiny_llama()
    result = plan_model(model, ByteTokenizer(), _config(kv=0.4), progress=False)
    ref = tiny_llama()
    compress(model, ByteTokenizer(), result.recipe, progress=False)
    kv = kv_bytes_per_token(model)["total"] / kv_bytes_per_token(ref)["total"]
    assert kv <= 0.4 and kv == pytest.approx(result.report["used"]["kv"])
    est = result.report["estimate"]
    assert est["measured"] <= est["measured_first"]
    assert est["measured"] <= min(s["measured"] for s in result.report["starts"].values())
    assert result.report["starts"][result.report["start"]]["measured"] == est["measured_start"]
    assert len(result.report["layers"]) == 4 and result.report["binding"] == ["kv"]


def test_the_public_planner_leaves_the_model_dense_and_its_recipe_compresses_it_within_budget() -> None:
    import attnslim

    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert attnslim.PlanConfig is PlanConfig  # _config's
    result = attnslim.plan_model(model, ByteTokenizer(), _config(kv=0.4), progress=False)
    assert isinstance(result, attnslim.PlanResult)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)  # still dense
    dense_kv = kv_bytes_per_token(model)["total"]
    attnslim.compress(model, ByteTokenizer(), result.recipe, progress=False)
    assert kv_bytes_per_token(model)["total"] <= 0.4 * dense_kv


@pytest.mark.parametrize("kw, message", [
    ({"kv": 0.0}, "the KV cache (--kv) budget is 0.0; give a fraction"),
    ({"kv": 0.5, "params": 1.5}, "budget is 1.5; give a fraction"),
    ({"kv": 0.5, "rounds": -1}, "PlanConfig.rounds=-1: give an integer >= 0"),
    ({"kv": 0.5, "score_windows": 0}, "PlanConfig.score_windows=0: give an integer >= 1"),
    ({"kv": 0.5, "decode_at": 1.5}, "PlanConfig.decode_at=1.5: give an integer >= 1"),
    ({"kv": 0.5, "kinds": ("mla", "lora")}, "unknown ['lora']"),
    ({"kv": 0.5, "engine": "sglang"}, "engine 'sglang' is unknown"),
    ({"kv": 0.5, "mla_args": {"kv_ratio": 0.3}}, "set by the planner per candidate"),
    ({"kv": 0.5, "fit_steps": -1}, "PlanConfig.fit_steps=-1: give an integer >= 0"),
    ({"kv": 0.5, "kinds": ("keep", "nbl"), "fit_steps": 4}, "mla is not among the candidates ['keep', 'nbl']"),
    ({"kv": 0.5, "fit_steps": 4, "mla_args": {"local_steps": 4}}, "both fit the plan's mla layers: give one"),
])
def test_plan_config_refuses_what_no_plan_can_use_before_any_measurement(kw: dict[str, object], message: str) -> None:
    with pytest.raises(AttnslimError, match=re.escape(message)):
        PlanConfig(**kw)  # type: ignore[arg-type]


def test_calibration_is_raised_to_what_the_output_refit_needs_as_compress_raises_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """mla's output refit needs 24 tokens per o_proj input (24 x 65 = 1,560 on the tiny Llama's 64 inputs); the
    planner's 8 x 32 tokens are raised to 49 windows before any fit, as compress raises a recipe's, and the plan's
    recipe records them. Before, every mla candidate was refused after the measurement (Gemma-3 270M: 16,384 of
    24,600 tokens), and the plan failed."""
    model = tiny_llama()
    cfg = _config(kv=0.75, kinds=("keep", "mla"), mla_args={"refit_o": True}, rounds=0)
    result = plan_model(model, ByteTokenizer(), cfg, progress=False)
    said = capsys.readouterr().out
    assert "calibration raised from 8 to 49 windows of 32 tokens: the planner's candidate mla@" in said
    assert result.recipe.calibration.windows == 49 and result.report["calibration"]["windows"] == 49
    assert any(row["choice"].startswith("mla") for row in result.report["layers"])
    report = compress(model, ByteTokenizer(), result.recipe, progress=False, methods=result.methods)
    assert "calibration raised" not in capsys.readouterr().out and report.recipe["calibration"]["windows"] == 49


def test_unreachable_budget_is_refused_before_measuring() -> None:
    with pytest.raises(AttnslimError, match=r"below the smallest any plan reaches, 0\.25"):
        plan_model(tiny_llama(), ByteTokenizer(), _config(kv=0.1, kinds=("keep", "mla")), progress=False)


def test_engine_that_serves_no_candidate_names_the_layer() -> None:
    # vLLM's MLA widths (320, 576) exceed this tiny model's whole KV (2·2·16 values per layer)
    with pytest.raises(AttnslimError, match=r"layer 0: engine 'vllm' serves none of the candidates"):
        plan_model(tiny_llama(), ByteTokenizer(), _config(kv=0.5, kinds=("mla",), engine="vllm"), progress=False)


@pytest.mark.parametrize("argv, message", [
    (["plan", "--kv", "0", "--out", "{tmp}/p.yaml"], "in (0, 1]"),
    (["plan", "--kv", "1.5", "--out", "{tmp}/p.yaml"], "in (0, 1]"),
    (["plan", "--kv", "0.5", "--candidates", "mla,lora", "--out", "{tmp}/p.yaml"], "unknown ['lora']"),
    (["plan", "--kv", "0.5", "--out", "{tmp}/p.txt"], "must end in .yaml"),
    (["compress", "--kv", "0.5", "--recipe", "mla", "--out", "{tmp}/o"], "drop --recipe/--set"),
    (["compress", "--kv", "0.5", "--offload", "--out", "{tmp}/o"], "plan with `attnslim plan MODEL --kv F --offload"),
    (["plan", "--kv", "0.5", "--offload", "--candidates", "keep,ds", "--out", "{tmp}/p.yaml"], "not offered with "
     "--offload"),
    (["compress", "--ladder", "0.5", "--heal", "--out", "{tmp}/o"], "--ladder, --heal configure the planner, which "
     "runs only with --kv"),
    (["plan", "--kv", "0.5", "--local-steps", "-1", "--out", "{tmp}/p.yaml"], "--local-steps -1: give an integer"),
    (["plan", "--kv", "0.5", "--fit-steps", "-2", "--out", "{tmp}/p.yaml"], "--fit-steps -2: give an integer"),
    (["plan", "--kv", "0.5", "--fit-steps", "8", "--local-steps", "8", "--out", "{tmp}/p.yaml"], "give one"),
    (["compress", "--fit-steps", "96", "--out", "{tmp}/o"], "--fit-steps configures the planner"),
    (["plan", "--kv", "0.5", "--device", "tpu", "--out", "{tmp}/p.yaml"], "is not a device"),
    (["plan", "--kv", "0.5", "--dtype", "float8", "--out", "{tmp}/p.yaml"], "--dtype 'float8' is not supported"),
])
def test_bad_plan_arguments_are_refused_before_loading(tmp_path: object, capsys: pytest.CaptureFixture[str],
                                                      argv: list[str], message: str) -> None:
    assert cli_main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_default_calibration_is_self_wiki_wiki_under_offload_and_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    from attnslim.cli import build_parser
    from attnslim.cli_compress import plan_config

    assert PlanConfig(kv=0.5).calibration.source == "self+wiki"  # the API's default is the commands'
    for command in ("plan", "compress"):
        args = build_parser().parse_args([command, "smollm2-135m", "--kv", "0.5", "--out", "x"])
        assert plan_config(args).calibration.source == "self+wiki"
        err = capsys.readouterr().err
        assert "calibrating on self+wiki" in err and "--calib-source wiki+file:PATH" in err  # stderr: --json stays JSON
        args = build_parser().parse_args([command, "smollm2-135m", "--kv", "0.5", "--calib-source", "wiki",
                                          "--out", "x"])
        assert plan_config(args).calibration.source == "wiki" and capsys.readouterr().err == ""  # chosen: no note
    args = build_parser().parse_args(["plan", "smollm2-135m", "--kv", "0.5", "--offload", "--out", "x"])
    assert plan_config(args).calibration.source == "wiki"  # sampling needs the whole model, which --offload is not
    err = capsys.readouterr().err
    assert "--offload: calibrating on wiki, not the default self+wiki" in err and "wiki+file:PATH" in err
    assert cli_main(["compress", "smollm2-135m", "--kv", "0.5", "--candidates", "mla,bogus", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "calibrating on" not in err  # a refused command line prints its error alone


def test_a_plan_on_sampled_text_is_reproducible_and_measured_on_that_text() -> None:
    """The default calibration samples the dense model: the same seed gives the same costs and plan; the costs are
    measured on the sampled windows (they differ from the text-only calibration's)."""
    from helpers import BosTokenizer

    torch.manual_seed(0)
    model = tiny_llama(vocab_size=256)
    mixed = Calibration(source="self+tiny", windows=8, seq_len=32, seed=0, batch_size=4)
    runs = [plan_model(model, BosTokenizer(), _config(kv=0.6, calibration=cal), progress=False)
            for cal in (mixed, mixed, CAL)]
    costs = [{i: {label: o["kl"] for label, o in row.items()} for i, row in r.report["options"].items()} for r in runs]
    assert costs[0] == costs[1] and recipe_to_dict(runs[0].recipe) == recipe_to_dict(runs[1].recipe)
    assert costs[0] != costs[2]
    assert runs[0].report["calibration"]["source"] == "self+tiny"


def test_compress_kv_samples_the_models_own_text_once_and_compresses_as_a_fresh_draw_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compress --kv` (plan_and_compress) calibrates the compression on the windows the plan drew: the dense model's
    own text is sampled once (at 1.5B each sampling costs minutes), and the model equals plan + compress drawing its
    windows anew. Windows of another calibration are refused."""
    import copy
    from dataclasses import replace

    from attnslim.data import windows as windows_module
    from attnslim.planner import output
    from helpers import BosTokenizer

    real = windows_module.generated_windows
    seeds: list[int] = []

    def counted(model: object, tokenizer: object, n: int, seq_len: int, seed: int) -> torch.Tensor:
        seeds.append(seed)
        return real(model, tokenizer, n, seq_len, seed)

    monkeypatch.setattr(windows_module, "generated_windows", counted)
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=256)
    fresh, spare = copy.deepcopy(model), copy.deepcopy(model)
    cfg = _config(kv=0.6, calibration=Calibration(source="self+tiny", windows=8, seq_len=32, seed=0, batch_size=4))
    monkeypatch.setattr(output, "load_planned", lambda *a, **k: (model, BosTokenizer()))
    monkeypatch.setattr("attnslim.io.save", lambda *a, **k: tmp_path)  # the model is compared here, not its files
    result, _ = output.plan_and_compress("tiny", cfg, tmp_path / "out", progress=False)
    assert seeds.count(0) == 1 and sorted(set(seeds)) == [0, 1, 2]  # fit windows once; score, held-out windows
    seeds.clear()
    compress(fresh, BosTokenizer(), result.recipe, progress=False)  # draws the recipe's calibration itself
    assert seeds == [0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                  strict=True))
    other = replace(result.recipe, calibration=Calibration(source="tiny", windows=8, seq_len=32))
    with pytest.raises(AttnslimError, match=r"holds 8 x 32 tokens of 'self\+tiny'.*calibrates on 8 x 32 of 'tiny'"):
        compress(spare, BosTokenizer(), other, progress=False, windows=result.windows)
    with pytest.raises(TypeError, match="windows must be the attnslim TokenWindows"):
        compress(spare, BosTokenizer(), result.recipe, progress=False, windows=result.windows.ids)


def test_cli_plan_writes_an_editable_recipe_and_compress_kv_records_the_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from attnslim.io import load
    from attnslim.recipe import load_recipe
    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = tmp_path / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    options = ["--kv", "0.6", "--candidates", "keep,mla,nbl,drop", "--ladder", "0.5", "--calib-source", "tiny",
               "--calib-windows", "4", "--score-windows", "2", "--rounds", "1"]
    assert cli_main(["plan", str(ckpt), *options, "--out", str(tmp_path / "plan.yaml")]) == 0
    assert "binding: kv" in capsys.readouterr().out
    recipe = load_recipe(tmp_path / "plan.yaml")  # the recipe's own checks pass on what plan wrote
    report = json.loads((tmp_path / "plan.report.json").read_text())
    step_of = {i: ("mla@0.5" if s.method == "mla" else s.method) for s in recipe.steps for i in s.layers}
    assert [r["choice"] for r in report["layers"]] == [step_of.get(i, "keep") for i in range(4)]
    assert cli_main(["compress", str(ckpt), *options, "--out", str(tmp_path / "out")]) == 0
    info = json.loads((tmp_path / "out" / "compression.json").read_text())
    assert info["planner"]["budgets"] == {"kv": 0.6} and info["planner"]["kv_measured"] <= 0.6
    assert info["kv_bytes_per_token_after"] / info["kv_bytes_per_token_before"] == info["planner"]["kv_measured"]
    load(tmp_path / "out")


def test_plan_and_compress_kv_in_bfloat16_choose_and_save_in_that_dtype(tmp_path: Path) -> None:
    """`--dtype bfloat16` (how a 7B-8B model plans on one GPU): the planner measures the bfloat16 model, the plan
    holds the budget, and `compress --kv` saves bfloat16 weights with the compute recorded."""
    import json

    from safetensors import safe_open

    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = tmp_path / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    options = ["--kv", "0.6", "--candidates", "keep,mla,nbl,drop", "--ladder", "0.5", "--calib-source", "tiny",
               "--calib-windows", "4", "--score-windows", "2", "--rounds", "1", "--dtype", "bfloat16"]
    assert cli_main(["plan", str(ckpt), *options, "--out", str(tmp_path / "plan.yaml")]) == 0
    report = json.loads((tmp_path / "plan.report.json").read_text())
    assert report["used"]["kv"] <= 0.6 and any(r["kl"] > 0 for r in report["layers"])
    assert cli_main(["compress", str(ckpt), *options, "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    info = json.loads((tmp_path / "out" / "compression.json").read_text())
    assert info["compute"] == {"device": "cpu", "dtype": "bfloat16", "offload": False}
    assert info["planner"]["kv_measured"] <= 0.6
    shard = next((tmp_path / "out").glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        floats = {t.dtype for t in (f.get_tensor(k) for k in f.keys()) if t.is_floating_point()}  # noqa: SIM118
    assert floats == {torch.bfloat16}


def _counted_fits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers the pipeline's local fit runs on, in order, from now on (the fit itself still runs)."""
    from attnslim.pipeline import run as pipeline_run

    fits: list[int] = []
    real = pipeline_run.fit_locally

    def counted(runner: object, adapter: object, layer: int, *args: object) -> object:
        fits.append(layer)
        return real(runner, adapter, layer, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline_run, "fit_locally", counted)
    return fits


def test_local_steps_fit_every_mla_candidate_when_measured_and_in_the_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--local-steps N`: each mla candidate is measured after recipes/mla-kv25.yaml's local fit (one fit per layer
    and width, none without the option), and the plan's mla steps carry the fit. `--fit-steps N` puts the same fit
    in the plan's mla steps and fits nothing while planning."""
    from attnslim.recipe import load_recipe
    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = tmp_path / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    fits = _counted_fits(monkeypatch)
    options = ["--kv", "0.6", "--candidates", "keep,mla", "--ladder", "0.25,0.5", "--calib-source", "tiny",
               "--calib-windows", "8", "--score-windows", "2", "--rounds", "0"]  # the fit holds out a batch of 4
    for steps in (0, 3):
        fits.clear()
        out = tmp_path / f"plan{steps}.yaml"
        assert cli_main(["plan", str(ckpt), *options, "--local-steps", str(steps), "--out", str(out)]) == 0
        assert sorted(fits) == ([0, 0, 1, 1, 2, 2, 3, 3] if steps else [])  # two widths at each of the 4 layers
        mla_steps = [s for s in load_recipe(out).steps if s.method == "mla"]
        assert mla_steps and all(s.args.get("local_steps", 0) == steps for s in mla_steps)
    fits.clear()
    out = tmp_path / "fitted.yaml"
    assert cli_main(["plan", str(ckpt), *options, "--fit-steps", "3", "--out", str(out)]) == 0
    assert fits == []
    mla_steps = [s for s in load_recipe(out).steps if s.method == "mla"]
    assert mla_steps and all(s.args["local_steps"] == 3 for s in mla_steps)


def test_fit_steps_fit_only_the_chosen_mla_layers_after_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--fit-steps N` (PlanConfig.fit_steps): no candidate is fitted while the plan is measured, so the costs and
    the choice are the unfitted plan's; the recipe's mla steps carry the fit (and nothing else does), and compressing
    it fits each chosen mla layer once."""

    fits = _counted_fits(monkeypatch)
    kinds = ("keep", "mla", "nbl")
    plain = plan_model(tiny_llama(), ByteTokenizer(), _config(kv=0.3, kinds=kinds, rounds=0), progress=False)
    fitted = plan_model(tiny_llama(), ByteTokenizer(), _config(kv=0.3, kinds=kinds, rounds=0, fit_steps=3),
                        progress=False)
    assert fits == []  # planning fitted nothing
    assert fitted.report["options"] == plain.report["options"] and fitted.report["layers"] == plain.report["layers"]
    assert fitted.report["config"]["fit_steps"] == 3
    steps = {s.method: s for s in fitted.recipe.steps}
    assert "mla" in steps and "nbl" in steps  # a mixed plan: the fit goes to its mla steps only
    for before, after in zip(plain.recipe.steps, fitted.recipe.steps, strict=True):
        extra = {"local_steps": 3} if before.method == "mla" else {}
        assert after.layers == before.layers and dict(after.args) == {**before.args, **extra}
    compress(tiny_llama(), ByteTokenizer(), fitted.recipe, progress=False)
    mla_layers = sorted(i for s in fitted.recipe.steps if s.method == "mla" for i in s.layers)
    assert sorted(fits) == mla_layers


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_scoring_from_a_layer_equals_the_whole_forward(family: str) -> None:
    """kl_from(i) runs layers i.. on the recorded dense inputs of layer i: with only layer i changed it must give
    the KL of the whole model's forward."""
    from attnslim.calib.runner import LayerRunner
    from attnslim.modules.dropped import DroppedAttention
    from attnslim.planner.score import kl, kl_from, log_probs, score_set
    from conftest import TINY_BUILDERS

    model = TINY_BUILDERS[family]()
    adapter = get_adapter(model)
    scores = score_set(model, ByteTokenizer(), "tiny", 2, 16, seed=1)
    runner = LayerRunner(model, adapter, scores.ids, scores.ids.shape[0])
    for i in range(2):
        runner.run_layer(i)
    adapter.replace_attention(2, DroppedAttention(2, model.config.hidden_size))
    whole = kl(model, scores)
    assert whole > 1e-4
    assert kl_from(model, adapter, scores, 2, runner.hidden[0]) == pytest.approx(whole, rel=1e-4, abs=1e-7)
    got = log_probs(model, scores.ids, scores.positions)  # the definition, KL(dense ‖ model) per scored token
    want = float(torch.nn.functional.kl_div(got, scores.reference, log_target=True, reduction="sum")) / scores.tokens
    assert whole == pytest.approx(want, rel=1e-6)


def test_params_and_decode_budgets_hold_on_the_compressed_model() -> None:
    model, ref = tiny_llama(), tiny_llama()
    cfg = _config(kv=0.6, params=0.97, decode_bytes=0.6, decode_at=64)
    result = plan_model(model, ByteTokenizer(), cfg, progress=False)
    used = result.report["used"]
    assert used["params"] <= 0.97 and used["decode"] <= 0.6 and used["kv"] <= 0.6
    compress(model, ByteTokenizer(), result.recipe, progress=False)
    params = get_adapter(model).param_groups()["total"] / get_adapter(ref).param_groups()["total"]
    assert params == pytest.approx(used["params"]) and params <= 0.97
    kv, kv_ref = kv_bytes_per_token(model)["per_layer"], kv_bytes_per_token(ref)["per_layer"]
    decode = decode_bytes_per_token(model, 64, kv)["total"] / decode_bytes_per_token(ref, 64, kv_ref)["total"]
    assert decode == pytest.approx(used["decode"]) and decode <= 0.6


def test_vllm_engine_offers_only_its_mla_widths_and_kv_free_layers() -> None:
    from attnslim.planner.run import layer_options

    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    cands = candidate_set(engine="vllm")
    assert [c.label for c in cands] == ["keep", "mla@256+64", "mla@512+64", "nbl", "drop"]
    assert cands[1].args["layout"] == "deepseek"
    rows, refused = layer_options(get_adapter(model), cands, 64, "vllm")
    assert [[c.label for c, _ in row] for row in rows] == [["keep", "mla@256+64", "nbl", "drop"]] * 4
    assert [r.kv_bytes for c, r in rows[0] if c.kind == "mla"] == [320 * 4]  # kv_lora_rank 256 + rope 64, float32
    assert "exceeds" in refused["0"]["mla@512+64"]  # 512 latent dims > this layer's 2·n_kv·d_h − d_rope


def test_plan_heal_flag_ends_the_recipe_with_the_default_heal_on_self_text_when_calibrated_on_it(
        tmp_path: Path) -> None:
    from attnslim.recipe import load_recipe
    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = tmp_path / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    default = load_recipe("default").heal
    assert default is not None
    options = ["--kv", "0.6", "--candidates", "keep,mla", "--ladder", "0.5", "--calib-windows", "4",
               "--score-windows", "1", "--rounds", "0", "--heal"]
    assert cli_main(["plan", str(ckpt), *options, "--calib-source", "tiny", "--out", str(tmp_path / "a.yaml")]) == 0
    assert load_recipe(tmp_path / "a.yaml").heal == default
    from attnslim.planner.run import standard_heal

    assert standard_heal("self+tiny") == {**default, "source": "self+tiny"} and standard_heal("wiki") == default
    assert standard_heal("wiki+file:code.txt") == {**default, "source": "wiki+file:code.txt"}  # the user's domain


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_dense_attention_runs_once_per_batch_for_all_refitted_candidates(family: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The output refit of every mla candidate of a layer matches the same dense attention on the same batches:
    measure computes it once per batch (measure._Remembered) and the measured costs are those of computing it
    afresh for each candidate, bit for bit."""
    from attnslim.planner import measure as measuring
    from attnslim.planner.score import score_set
    from conftest import TINY_BUILDERS

    cal = Calibration(source="tiny", windows=56, seq_len=32, seed=0, batch_size=8)  # 24 tokens per dim
    cands = candidate_set(("keep", "mla"), (0.5, 0.75), "hf", {"refit_o": True})

    def run(remember: bool) -> tuple[dict[tuple[int, str], float], int]:
        model = TINY_BUILDERS[family]()
        adapter = get_adapter(model)
        calls = [0]
        adapter.attention(1).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        if not remember:
            monkeypatch.setattr(measuring, "_Remembered", lambda attention: attention)
        from attnslim.data import calib_windows
        fit = calib_windows("tiny", ByteTokenizer(), cal.windows, cal.seq_len, 0)
        scores = score_set(model, ByteTokenizer(), "tiny", 2, 16, seed=1)
        got = measuring.measure(model, adapter, {1: cands}, fit.ids, scores, cal.batch_size, progress=False)
        return got.quality, calls[0]

    remembered, once = run(True)
    afresh, each = run(False)
    batches = cal.windows // cal.batch_size
    assert remembered == afresh and remembered[(1, "mla@0.5")] > 0
    # the second mla candidate's refit ran the dense attention on every batch only when it was not remembered
    assert each - once == batches


def test_planning_a_model_attnslim_compressed_already_is_refused() -> None:
    model = tiny_llama(num_hidden_layers=3)
    c = _by_label(mla_args={})
    recipe, methods = plan_recipe([c["mla@0.5"], c["keep"], c["keep"]], "once", "", CAL)  # type: ignore[arg-type]
    compress(model, ByteTokenizer(), recipe, progress=False, methods=methods)
    with pytest.raises(AttnslimError, match="already compressed by attnslim"):
        plan_model(model, ByteTokenizer(), _config(kv=0.5))


def test_vllm_engine_offers_mla_on_a_biased_model_by_folding_its_biases() -> None:
    from attnslim.planner.run import layer_options
    from conftest import tiny_qwen25

    model = tiny_qwen25(hidden_size=512, num_key_value_heads=4)  # head_dim 128: dense KV 1,024 values per layer
    cands = candidate_set(("keep", "mla"), engine="vllm", rotary_dims=128)
    assert [c.args["biases"] for c in cands if c.kind == "mla"] == ["fold", "fold"]
    rows, refused = layer_options(get_adapter(model), cands, 64, "vllm")
    assert [c.label for c, _ in rows[0]] == ["keep", "mla@256+64", "mla@512+64"] and not refused


def _wide_llama() -> torch.nn.Module:
    """Dense KV 512 values per layer: MLA at vLLM's 256 + 64 keeps 0.625 of it."""
    return tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_hidden_layers=3)


@pytest.mark.parametrize("kv", [0.7, 0.5])
def test_a_vllm_plan_holds_the_layer_kinds_of_one_route_that_serves_it(kv: float) -> None:
    """No vLLM model mixes MLA layers with others: the plan is all MLA (the DeepSeek-V3 export) or keep/nbl/drop
    (attnslim's plugin), whichever measures better; at KV 0.5 the all-MLA route (0.625) cannot hold the budget."""
    cal = Calibration(source="tiny", windows=10, seq_len=32, seed=0, batch_size=4)  # NBL: > 256 tokens at width 256
    cfg = _config(kv=kv, engine="vllm", kinds=("keep", "mla", "nbl", "drop"), calibration=cal)
    result = plan_model(_wide_llama(), ByteTokenizer(), cfg, progress=False)
    report = result.report
    kinds = {row["choice"].split("@")[0] for row in report["layers"]}  # keep, mla@256+64, nbl, drop
    assert kinds == {"mla"} or kinds <= {"keep", "nbl", "drop"}
    assert report["route"] in report["serving"] and "transformers" in report["serving"]
    assert set(report["routes"]) == {"plugin", "deepseek-v3"}
    if kv == 0.5:
        assert report["route"] == "plugin" and "0.625" in report["routes"]["deepseek-v3"]["refused"]
    else:  # both routes planned and measured whole; the lower measured cost won
        costs = {route: r["measured"] for route, r in report["routes"].items()}
        assert report["route"] == min(costs, key=lambda route: costs[route])


def test_a_vllm_plan_no_route_can_hold_is_refused_before_any_measurement() -> None:
    from conftest import tiny_qwen3, tiny_qwen25

    with pytest.raises(AttnslimError, match=r"no vLLM route .* plugin: it serves llama, qwen2 models; this one is "
                                            r"'qwen3'; deepseek-v3: it serves llama, mistral, qwen2 models"):
        plan_model(tiny_qwen3(), ByteTokenizer(), _config(kv=0.5, engine="vllm"), progress=False)
    model = tiny_qwen25(hidden_size=512, num_key_value_heads=4)  # head_dim 128: MLA at 320 keeps 0.3125 of 1,024
    with pytest.raises(AttnslimError, match=r"no vLLM route .* plugin: .*budget 0.05 .*deepseek-v3: .*0\.3125"):
        plan_model(model, ByteTokenizer(), _config(kv=0.05, engine="vllm", kinds=("keep", "mla")), progress=False)


def test_every_plan_report_names_the_routes_that_serve_it() -> None:
    from attnslim.engines import routes

    assert routes(["keep", "drop", "nbl"], "llama", mla_served=False) == ["transformers", "plugin"]
    assert routes(["keep", "drop"], "llama", mla_served=False) == ["transformers", "plugin", "deci"]
    assert routes(["drop", "keep"], "llama", mla_served=False) == ["transformers", "plugin"]  # DeciLM keeps layer 0
    assert routes(["mla", "mla"], "qwen2", mla_served=True) == ["transformers", "deepseek-v3"]
    assert routes(["mla", "mla"], "llama", mla_served=False) == ["transformers"]  # widths vLLM does not take
    assert routes(["mla", "keep"], "llama", mla_served=True) == ["transformers"]
    assert routes(["keep", "nbl"], "qwen2", mla_served=False) == ["transformers", "plugin"]
    assert routes(["keep", "drop"], "qwen2", mla_served=False) == ["transformers", "plugin"]  # DeciLM: Llama only
    assert routes(["keep", "nbl"], "gemma3_text", mla_served=False) == ["transformers"]
    report = plan_model(tiny_llama(), ByteTokenizer(), _config(kv=0.5), progress=False).report
    assert report["route"] == "any" and list(report["routes"]) == ["any"]
    assert "transformers" in report["serving"]
