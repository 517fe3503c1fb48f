"""`attnslim export --to deci`: a Llama whose attention layers are kept or dropped becomes a DeciLM (nemotron-nas)
checkpoint: per-layer block_configs, the source's own tensors under Llama's names (none for a dropped layer's
attention), the config class vLLM reads; every other kind of layer is refused, naming what serves it, before any
output. (vLLM serving the export: tests/test_serving_deci.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from attnslim.api import compress
from attnslim.errors import AttnslimError
from attnslim.export import export_deci
from attnslim.export.deci_check import check_directory
from attnslim.io import save
from attnslim.recipe import recipe_from_dict, recipe_to_dict
from conftest import tiny_llama, tiny_mistral
from helpers import SavingTokenizer, one_step

pytestmark = pytest.mark.usefixtures("one_thread")
DROPPED = [1, 3]


def _compressed(model, *steps):
    """`model` compressed by one recipe of the steps (method, args, layers); its report (JSON) with it."""
    recipe = recipe_to_dict(one_step(*steps[0]))
    recipe["steps"] = [{"method": method, "args": args, "layers": layers} for method, args, layers in steps]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, SavingTokenizer(), recipe_from_dict(recipe), progress=False)
    return model, report.to_json()


def _dropped(**config):
    return _compressed(tiny_llama(**config), ("drop", {"select": "given"}, DROPPED))[0]


def test_block_configs_say_per_layer_what_vllm_builds(tmp_path):
    from transformers import AutoConfig

    report = export_deci(_dropped(), SavingTokenizer(), tmp_path / "deci")
    config = json.loads((tmp_path / "deci" / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    for i, block in enumerate(config["block_configs"]):
        assert block["attention"]["no_op"] is (i in DROPPED)
        # 4 heads over 2 KV heads in the tiny Llama; a dropped layer names no head count
        assert block["attention"].get("n_heads_in_group") == (None if i in DROPPED else 2)
        assert block["ffn"] == {"no_op": False, "replace_with_linear": False, "intermediate_size": 96}
    assert report["no_op_attention_layers"] == DROPPED and report["kv_tokens_vs_dense"] == 4 / 2
    # what vLLM's DeciLM reads, through the shipped config class (trust_remote_code: the directory's own file)
    loaded = AutoConfig.from_pretrained(tmp_path / "deci", trust_remote_code=True)
    assert [b.attention.no_op for b in loaded.block_configs] == [i in DROPPED for i in range(4)]
    assert not hasattr(loaded.block_configs[0].ffn, "ffn_mult")  # so vLLM takes intermediate_size as it is
    assert loaded.block_configs[0].ffn.intermediate_size == 96
    assert loaded.block_configs[2].attention.n_heads_in_group == 2


@pytest.mark.parametrize("config,dtype", [({}, "float32"),
                                          ({"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
                                           "float32"),
                                          ({}, "bfloat16")])
def test_weights_are_the_sources_under_llamas_names_without_a_dropped_layers_attention(tmp_path, config, dtype):
    model = _dropped(**config)
    source = model.state_dict()
    export_deci(model, SavingTokenizer(), tmp_path / "deci", dtype=dtype)
    exported = load_file(tmp_path / "deci" / "model.safetensors")
    gone = {n for n in source if any(n.startswith(f"model.layers.{i}.{part}") for i in DROPPED
                                     for part in ("self_attn.", "input_layernorm."))}
    tied = model.config.tie_word_embeddings
    assert set(exported) == set(source) - gone - ({"lm_head.weight"} if tied else set())
    assert any(n.endswith("self_attn.q_proj.bias") for n in exported) == bool(config.get("attention_bias"))
    for name, tensor in exported.items():
        assert tensor.dtype == getattr(torch, dtype) and torch.equal(tensor, source[name].to(tensor.dtype)), name


def _refused(model, match, tmp_path):
    with pytest.raises(AttnslimError, match=match):
        export_deci(model, SavingTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method,args,match", [
    ("nbl", {"m": 1}, r"layers \d \(nbl\) replaces attention by a linear map.*`attnslim serve DIR`"),
    ("mla", {"kv_ratio": 0.5, "rope_dims": 16, "layout": "deepseek"}, r"\(mla\) is MLA: .*--to deepseek-v3"),
    ("ds", {}, r"\(lisa\) shares attention scores across layers"),
])
def test_other_methods_layers_are_refused_naming_what_serves_them(tmp_path, method, args, match):
    layers = [3] if method == "ds" else [2, 3]  # ds: layer 3 takes dense layer 2's scores
    model, _ = _compressed(tiny_llama(), ("drop", {"select": "given"}, [1]), (method, args, layers))
    _refused(model, match, tmp_path)


def test_layer_0_dropped_non_llama_and_factorised_linears_are_refused(tmp_path):
    first = _compressed(tiny_llama(), ("drop", {"select": "given"}, [0, 2]))[0]
    _refused(first, r"layer 0 has no attention .* `attnslim serve DIR`", tmp_path)
    mistral, record = _compressed(tiny_mistral(), ("drop", {"select": "given"}, [1]))
    _refused(mistral, r"supports llama models .* this one is 'mistral'", tmp_path)
    saved = save(mistral, SavingTokenizer(), tmp_path / "mistral", record)  # the CLI's check, before any load
    with pytest.raises(AttnslimError, match=r"supports llama models .*mistral is 'mistral'"):
        check_directory(saved)
    svd = _compressed(tiny_llama(), ("drop", {"select": "given"}, [1]), ("svd", {"ratio": 0.5, "linears": ["up"]},
                                                                          [2]))[0]
    _refused(svd, r"layer 2 up are not dense Linears", tmp_path)


def test_the_directory_check_refuses_before_loading_and_the_cli_writes_the_export(tmp_path):
    model, report = _compressed(tiny_llama(), ("drop", {"select": "given"}, [1]), ("nbl", {"m": 1}, [2, 3]))
    nbl = save(model, SavingTokenizer(), tmp_path / "nbl", report)
    with pytest.raises(AttnslimError, match=r"layers [23] \(nbl\) .*attnslim serve"):
        check_directory(nbl)
    model, report = _compressed(tiny_llama(), ("drop", {"select": "given"}, DROPPED))
    drop = save(model, SavingTokenizer(), tmp_path / "drop", report)
    assert check_directory(drop) == DROPPED
    run = [sys.executable, "-m", "attnslim", "export", str(drop), "--to", "deci", "--out", str(tmp_path / "deci")]
    bad = subprocess.run(run + ["--kv-lora-rank", "512"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--kv-lora-rank is an option of --to deepseek-v3" in bad.stderr
    done = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["no_op_attention_layers"] == DROPPED
    exported, q = load_file(tmp_path / "deci" / "model.safetensors"), "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(exported[q], model.state_dict()[q])


def test_attnslim_serve_passes_trust_remote_code_only_for_attnslims_own_config_class(tmp_path):
    from attnslim.serving.launch import deci_arguments

    export_deci(_dropped(), SavingTokenizer(), tmp_path / "deci")
    assert deci_arguments(tmp_path / "deci") == ["--trust-remote-code"]
    code = tmp_path / "deci" / "configuration_decilm.py"
    code.write_text(code.read_text() + "\nimport os  # any other code\n")
    with pytest.raises(AttnslimError, match="config class is not the one this attnslim writes"):
        deci_arguments(tmp_path / "deci")
    assert deci_arguments(tmp_path) == []  # no config.json: not a DeciLM export, vLLM names what is missing
