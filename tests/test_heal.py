"""Healing (train/heal.py): which parameters train, the KL objective, the recipe `heal` section, bad input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.recipe import apply_overrides, fingerprint, recipe_from_dict, recipe_to_dict
from attnslim.train.heal import HealConfig, distill_kl, heal, heal_loss, healing_parameters, hidden_distance
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
SOURCE = {"source": "tiny", "seq_len": 32, "batch_size": 2}


def _sharp_llama():
    """A tiny Llama with peaked output distributions (a random init is near uniform, so every KL is ~0)."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return model


def _held_out():
    from attnslim.data import eval_windows

    return eval_windows("tiny", ByteTokenizer(), tokens=128, seq_len=32).ids  # (4, 32)


def _svd(model, ratio=0.3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, ByteTokenizer(), one_step("svd", {"ratio": ratio, "linears": ["q", "o"]}, layers=[1, 2]),
                 progress=False)
    return model


def test_distill_kl_is_zero_for_equal_logits_and_matches_the_definition():
    t = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    s = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1))
    assert float(distill_kl(t, t, 2.0)) == pytest.approx(0.0, abs=1e-6)
    p = F.softmax(t / 2.0, -1)
    manual = (p * (F.log_softmax(t / 2.0, -1) - F.log_softmax(s / 2.0, -1))).sum(-1).mean() * 4.0
    assert float(distill_kl(s, t, 2.0)) == pytest.approx(float(manual), rel=1e-5)


def test_hidden_distance_is_relative_per_position_and_the_heal_loss_adds_it_with_its_weight():
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(2, 5, 8, generator=g), 100.0 * torch.randn(2, 5, 8, generator=g))
    s = (t[0] + 0.1 * torch.randn(2, 5, 8, generator=g), t[1] * 1.5)
    assert float(hidden_distance(t, t)) == 0.0
    rel0 = ((s[0] - t[0]) ** 2).sum(-1) / (t[0] ** 2).sum(-1)  # (b, t)
    assert float(hidden_distance(s, t)) == pytest.approx(float((rel0.mean() + 0.25) / 2), rel=1e-5)  # scale-free
    teacher = _sharp_llama()
    student = _svd(copy.deepcopy(teacher))
    with torch.no_grad():
        kl = float(heal_loss(student, teacher, IDS, HealConfig(source="tiny")))
        both = float(heal_loss(student, teacher, IDS, HealConfig(source="tiny", hidden=2.0)))
        want, got = (m(input_ids=IDS, output_hidden_states=True) for m in (teacher, student))
    assert kl == pytest.approx(float(distill_kl(got.logits, want.logits, 1.0)), rel=1e-5)
    dist = float(hidden_distance(got.hidden_states[1:], want.hidden_states[1:]))
    assert dist > 0 and both == pytest.approx(kl + 2.0 * dist, rel=1e-5)


def test_the_hidden_term_pulls_hidden_states_closer_than_the_logits_alone():
    teacher = _sharp_llama()
    ids, dist = _held_out(), {}
    for w in (0.0, 10.0):
        student = _svd(copy.deepcopy(teacher))
        heal(student, teacher, ByteTokenizer(), HealConfig(steps=20, batch_size=2, seq_len=32, lr=3e-3, source="tiny",
                                                           hidden=w), progress=False)
        with torch.no_grad():
            want, got = (m(input_ids=ids, output_hidden_states=True) for m in (teacher, student))
        dist[w] = float(hidden_distance(got.hidden_states[1:], want.hidden_states[1:]))
    assert dist[10.0] < 0.8 * dist[0.0], dist


def test_changed_parameters_are_the_new_factors_and_all_excludes_the_embedding():
    teacher = tiny_llama()
    student = _svd(copy.deepcopy(teacher))
    changed = healing_parameters(student, teacher, "changed")
    assert changed and all(".layers.1." in n or ".layers.2." in n for n in changed)
    assert all(n.endswith((".a", ".b")) for n in changed)
    everything = healing_parameters(student, teacher, "all")
    assert "model.embed_tokens.weight" not in everything and set(changed) < set(everything)


def test_heal_lowers_the_kl_and_trains_only_the_selected_parameters():
    teacher = _sharp_llama()
    student = _svd(copy.deepcopy(teacher))
    frozen = {n: p.detach().clone() for n, p in student.named_parameters()
              if n not in healing_parameters(student, teacher, "changed")}
    flags = {n: p.requires_grad for n, p in student.named_parameters()}
    ids = _held_out()  # the eval split: healing trains on the calibration split
    with torch.no_grad():
        before = float(distill_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0))
    report = heal(student, teacher, ByteTokenizer(), HealConfig(steps=30, batch_size=2, seq_len=32, lr=3e-3,
                                                                  source="tiny"), progress=False)
    with torch.no_grad():
        after = float(distill_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0))
    assert after < 0.85 * before, (before, after)
    assert report["kl_last"] < report["kl_first"] and len(report["history"]) == 30
    assert all(torch.equal(p, frozen[n]) for n, p in student.named_parameters() if n in frozen)
    assert {n: p.requires_grad for n, p in student.named_parameters()} == flags and not student.training


def test_recipe_heal_section_runs_after_the_steps_and_is_validated():
    base = recipe_to_dict(one_step("svd", {"ratio": 0.3, "linears": ["q", "o"]}, layers=[1, 2]))
    base["calibration"].update(SOURCE)
    plain = recipe_from_dict(base)
    assert "heal" not in recipe_to_dict(plain)  # fingerprints of recipes without healing do not change
    healed = apply_overrides(plain, ["heal.steps=30", "heal.lr=0.003", "heal.source=tiny", "heal.seq_len=32",
                                     "heal.batch_size=2"])
    assert healed.heal is not None and healed.heal["steps"] == 30 and healed.heal["params"] == "changed"
    assert fingerprint(healed) != fingerprint(plain)
    assert recipe_from_dict(recipe_to_dict(healed)) == healed
    # a setting added later is left out at its default: recipes written before it keep their fingerprint
    assert "hidden" not in healed.heal
    assert fingerprint(apply_overrides(healed, ["heal.hidden=0"])) == fingerprint(healed)
    deep = apply_overrides(healed, ["heal.hidden=10"])
    assert deep.heal is not None and deep.heal["hidden"] == 10 and fingerprint(deep) != fingerprint(healed)
    teacher, unhealed, model = _sharp_llama(), _sharp_llama(), _sharp_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = compress(unhealed, ByteTokenizer(), plain, progress=False)
        b = compress(model, ByteTokenizer(), healed, progress=False)
    assert a.heal is None and b.heal is not None and b.heal["kl_last"] < b.heal["kl_first"]
    assert b.params_after == a.params_after
    ids = _held_out()
    with torch.no_grad():
        target = teacher(input_ids=ids).logits
        kl_plain = float(distill_kl(unhealed(input_ids=ids).logits, target, 1.0))
        kl_healed = float(distill_kl(model(input_ids=ids).logits, target, 1.0))
    assert kl_healed < kl_plain, (kl_plain, kl_healed)  # the heal ran inside compress, after the steps


@pytest.mark.parametrize(
    ("heal_args", "match"),
    [({"steps": 0}, "heal.steps=0"), ({"lr": -1}, "heal.lr=-1"), ({"params": "some"}, "changed | all"),
     ({"stepz": 3}, "unknown key"), ({"temperature": 0}, "heal.temperature"),
     ({"source": "wikii"}, "heal.source must be one of"), ({"source": "wiki+"}, "'wiki\\+'"),
     ({"hidden": -1}, "heal.hidden=-1"), ({"teacher_dtype": "float16"}, "float32 | bfloat16"),
     ({"checkpoint": "yes"}, "heal.checkpoint='yes' is invalid; valid: true | false"),
     ({"precision": "float16"}, "heal.precision='float16' is invalid; valid: float32 | bfloat16 | auto")],
)
def test_bad_heal_settings_name_the_key(heal_args, match):
    d = recipe_to_dict(one_step("svd", {"ratio": 0.5}))
    with pytest.raises(AttnslimError, match=match):
        recipe_from_dict({**d, "heal": heal_args})


def _healed(**settings):
    """(student after a 6-step heal of an svd-compressed sharp tiny Llama, the heal's report, the teacher)."""
    teacher = _sharp_llama()
    student = _svd(copy.deepcopy(teacher))
    cfg = HealConfig(steps=6, batch_size=2, seq_len=32, lr=3e-3, source="tiny", **settings)
    return student, heal(student, teacher, ByteTokenizer(), cfg, progress=False), teacher


def test_checkpointing_gives_the_same_heal_and_is_undone():
    """Activation checkpointing recomputes each decoder layer's forward in the backward pass: the same losses and
    trained weights (to float rounding), and the student leaves the heal without it."""
    plain, a, _ = _healed()
    ckpt, b, _ = _healed(checkpoint=True)
    assert a["history"] == pytest.approx(b["history"], rel=1e-5, abs=1e-6)
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), n
    assert not ckpt.is_activation_checkpointing and b["config"]["checkpoint"] is True


def test_a_bfloat16_teacher_heals_like_a_float32_one():
    """teacher_dtype bfloat16: the teacher is cast in place and its targets move by bfloat16 rounding only, so
    the losses stay within a few % of the float32 teacher's and the heal still lowers them."""
    _, a, _ = _healed()
    _, b, teacher = _healed(teacher_dtype="bfloat16")
    assert next(teacher.parameters()).dtype == torch.bfloat16
    assert b["history"] == pytest.approx(a["history"], rel=0.05)
    assert b["kl_last"] < b["kl_first"]


def test_compress_copies_a_bfloat16_teacher_straight_and_heals_against_it():
    """heal.teacher_dtype bfloat16 in a recipe: the frozen teacher copy is made in bfloat16 (api._frozen_copy), its
    tied weights stay tied, the model it was copied from is untouched, and the heal inside compress lowers the KL."""
    from attnslim.api import _frozen_copy

    model = _sharp_llama()
    teacher = _frozen_copy(model, torch.bfloat16)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert teacher.lm_head.weight is teacher.model.embed_tokens.weight
    base = recipe_to_dict(one_step("svd", {"ratio": 0.3, "linears": ["q", "o"]}, layers=[1, 2]))
    base["calibration"].update(SOURCE)
    recipe = recipe_from_dict({**base, "heal": {"steps": 6, "lr": 3e-3, "source": "tiny", "seq_len": 32,
                                                "batch_size": 2, "teacher_dtype": "bfloat16", "checkpoint": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, ByteTokenizer(), recipe, progress=False)
    assert report.heal is not None and report.heal["kl_last"] < report.heal["kl_first"]
    assert report.heal["config"]["teacher_dtype"] == "bfloat16"


def test_new_heal_settings_keep_old_fingerprints():
    base = recipe_to_dict(one_step("svd", {"ratio": 0.3}))
    healed = recipe_from_dict({**base, "heal": {"steps": 2}})
    assert healed.heal is not None and "teacher_dtype" not in healed.heal and "checkpoint" not in healed.heal
    assert fingerprint(apply_overrides(healed, ["heal.teacher_dtype=float32", "heal.checkpoint=false",
                                                "heal.precision=float32"])) == fingerprint(healed)
    assert fingerprint(apply_overrides(healed, ["heal.precision=auto"])) != fingerprint(healed)


def test_bfloat16_precision_runs_the_forward_passes_in_bfloat16_and_trains_float32_weights():
    """precision bfloat16: the heal's loss comes from bfloat16 matmuls (it differs from the float32 loss, by
    rounding only), the trained weights, their gradients and AdamW's state stay float32, and the heal still
    lowers its loss; the report says which precision ran."""
    teacher = _sharp_llama()
    student = _svd(copy.deepcopy(teacher))
    with torch.no_grad():
        full = float(heal_loss(student, teacher, IDS, HealConfig(source="tiny"), "float32"))
        half = float(heal_loss(student, teacher, IDS, HealConfig(source="tiny"), "bfloat16"))
    assert half != full and half == pytest.approx(full, rel=0.1), (full, half)
    loss = heal_loss(student, teacher, IDS, HealConfig(source="tiny"), "bfloat16")
    loss.backward()
    trained = healing_parameters(student, teacher, "changed")
    assert loss.dtype == torch.float32
    assert {p.grad.dtype for p in trained.values()} == {torch.float32}
    plain, a, _ = _healed()
    half_model, b, _ = _healed(precision="bfloat16")
    assert a["precision"] == "float32" and b["precision"] == "bfloat16"
    assert b["history"] != a["history"] and b["history"] == pytest.approx(a["history"], rel=0.1)
    assert b["kl_last"] < b["kl_first"]
    assert {p.dtype for p in half_model.parameters()} == {torch.float32}


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_follows_the_device(monkeypatch, native):
    """auto: bfloat16 where host.native_bf16 says the device computes it natively, else float32; explicit
    settings are taken as written."""
    from attnslim import host
    from attnslim.train.heal import heal_precision

    monkeypatch.setattr(host, "native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert heal_precision(HealConfig(precision="auto"), cpu) == ("bfloat16" if native else "float32")
    assert heal_precision(HealConfig(precision="float32"), cpu) == "float32"
    assert heal_precision(HealConfig(precision="bfloat16"), cpu) == "bfloat16"


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    from attnslim import host

    for bf16, amx, want in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert host.native_bf16(torch.device("cpu")) is (want and torch.backends.mkldnn.is_available())
    assert host.native_bf16(torch.device("meta")) is False


def test_heal_refuses_when_nothing_was_compressed():
    model = tiny_llama()
    with pytest.raises(AttnslimError, match="no parameter was changed"):
        heal(model, tiny_llama(), ByteTokenizer(), HealConfig(steps=1, source="tiny", seq_len=32), progress=False)


@pytest.mark.real
def test_heal_on_smollm2_lowers_held_out_kl():
    from attnslim.data import eval_windows
    from attnslim.models import load_model

    teacher, tokenizer = load_model("smollm2-135m")
    student = copy.deepcopy(teacher)
    recipe = recipe_from_dict({
        "name": "t", "calibration": {"source": "wiki", "windows": 4, "seq_len": 128},
        "steps": [{"method": "svdllm", "layers": "20:24", "args": {"ratio": 0.4, "linears": ["q", "k", "v", "o"]}}],
    })
    compress(student, tokenizer, recipe, progress=False)
    ids = eval_windows("wiki", tokenizer, tokens=256, seq_len=128).ids  # held out: the eval split

    def kl() -> float:
        with torch.no_grad():
            return float(distill_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0))

    before = kl()
    report = heal(student, teacher, tokenizer, HealConfig(steps=10, batch_size=2, seq_len=128, lr=5e-4),
                  progress=False)
    assert report["tensors"] == 4 * 4 * 2  # A and B of q, k, v, o in 4 layers
    assert kl() < 0.9 * before
