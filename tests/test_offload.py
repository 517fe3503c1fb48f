"""Offloaded compression (attnslim.offload): the same weights, bit for bit, as compressing the model in memory, with
one decoder layer in memory at a time; refusals and bad input named before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnslim.api import check_recipe, compress, compress_offloaded
from attnslim.compress_memory import lean_heal, model_bytes, offload_reason
from attnslim.errors import AttnslimError
from attnslim.io import load, save
from attnslim.offload import OffloadedLayers
from attnslim.recipe import recipe_from_dict, recipe_to_dict
from helpers import SavingTokenizer, one_step

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [  # (family, method, args): every method that can run offloaded, on the families its tests use
    ("llama", "svdllm", {"ratio": 0.5}),
    ("gemma3", "asvd", {"ratio": 0.5}),
    ("llama", "latentllm", {"ratio": 0.6}),
    ("gemma3", "latentllm", {"ratio": 0.6, "mlp": "joint_ud"}),
    ("opt", "latentllm", {"ratio": None, "total_ratio": 0.9}),
    ("llama", "latentllm", {"ratio": 0.6, "alloc": "global"}),
    ("gemma3", "latentllm", {"ratio": 0.7, "mlp": "local", "alloc": "global"}),
    ("opt", "latentllm", {"ratio": 0.7, "alloc": "global", "sequential": False}),
    ("llama", "nbl", {"m": 2}),
    # probe: each candidate's trial module stays in memory through streamed forwards (offload/store.py)
    ("llama", "nbl", {"m": 1, "criterion": "probe"}),
    ("gemma3", "nbl", {"m": 2, "criterion": "probe", "input": "residual"}),
    ("gemma3", "nbl", {"m": 2, "sequential": True, "criterion": "cca"}),
    ("llama", "drop", {"count": 1}),
    ("opt", "atp", {}),
    ("llama", "lisa", {}),  # converting layer n rewires its donor, layer n-1 (Method.rewires)
    ("mistral", "lisa", {"rank": 4, "integrate": "add"}),
    ("opt", "ds", {}),
    ("opt", "mla", {}),
    ("llama", "mla", {"kv_ratio": 0.5}),
    ("llama", "mla", {"kv_ratio": 0.5, "alloc": "global"}),  # spectra computed while each layer is in memory
    ("llama", "mla", {"kv_ratio": 0.5, "refit_o": True}),  # the original attention runs beside the converted one
    ("mistral", "mla", {"kv_ratio": 0.5, "local_steps": 8}),  # ... and the converted one trains towards it
    ("llama", "transmla", {"kv_ratio": 0.5}),
    ("gemma3", "mla", {"kv_ratio": 0.5}),  # QK-norm: the key norm's gain is read while the layer is in memory
]
LAYERS = {"lisa": "1:", "ds": "1:"}  # sharing needs a donor below: layers 1-3, one chain (2 reads a converted 1)


def _checkpoint(family: str, directory: Path) -> Path:
    from conftest import TINY_BUILDERS

    TINY_BUILDERS[family]().save_pretrained(directory)
    SavingTokenizer().save_pretrained(directory)
    return directory


def _in_memory(src: Path, recipe, out: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    report = compress(model, SavingTokenizer(), recipe, progress=False)
    save(model, SavingTokenizer(), out, report.to_json())
    return report


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"tensors differ: {differ[:5]}"


@pytest.mark.parametrize("family,method,args", CASES,
                         ids=[f"{f}-{m}" + ("-global" if a.get("alloc") == "global" else "")
                              + ("-probe" if a.get("criterion") == "probe" else "")
                              + ("-refit" if a.get("refit_o") else "")
                              + ("-local" if a.get("local_steps") else "") for f, m, a in CASES])
def test_offloaded_equals_in_memory_bit_for_bit(family, method, args, tmp_path):
    src = _checkpoint(family, tmp_path / "src")
    # the output refit raises the calibration's windows itself (Method.calibration_need), offloaded from the meta
    # skeleton's o_proj width: both runs use the same raised count
    recipe = one_step(method, args, layers=LAYERS.get(method, "all"))
    memory = _in_memory(src, recipe, tmp_path / "mem")
    offloaded = compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)
    assert offloaded.steps[0]["plan"] == json.loads(json.dumps(memory.steps[0]["plan"]))
    assert offloaded.recipe == memory.recipe and offloaded.calibration == memory.calibration
    assert (offloaded.recipe["calibration"]["windows"] > 4) == bool(args.get("refit_o"))  # one_step's 4, raised
    assert offloaded.params_after == memory.params_after
    assert offloaded.kv_bytes_per_token_after == memory.kv_bytes_per_token_after
    assert_same_weights(_weights(tmp_path / "mem"), _weights(tmp_path / "off"))
    assert len(list((tmp_path / "off").glob("model-*.safetensors"))) == 4 + 1  # a shard per layer + the rest


@pytest.mark.parametrize("method,args", [("latentllm", {"ratio": 0.6}), ("lisa", {})])
def test_sharded_output_loads_to_the_same_logits(method, args, tmp_path):
    src = _checkpoint("llama", tmp_path / "src")
    recipe = one_step(method, args, layers=LAYERS.get(method, "all"))
    _in_memory(src, recipe, tmp_path / "mem")
    compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    mem, _ = load(tmp_path / "mem")
    with torch.no_grad():
        ref = mem(input_ids=ids).logits
        for offload in (False, True):  # the output loaded whole, and run with its layers on disk
            off, _ = load(tmp_path / "off", offload=offload)
            assert torch.equal(ref, off(input_ids=ids).logits)


def test_a_conversion_holds_the_layers_it_rewires(tmp_path, monkeypatch):
    from attnslim.methods.lisa import Lisa

    src = _checkpoint("llama", tmp_path / "src")
    seen = []
    real = Lisa.convert

    def convert(self, adapter, layer, entry, stats):
        blocks = adapter.decoder_layers()
        seen.append([j for j, block in enumerate(blocks) if all(p.device.type != "meta" for p in block.parameters())])
        return real(self, adapter, layer, entry, stats)

    monkeypatch.setattr(Lisa, "convert", convert)
    compress_offloaded(src, one_step("lisa", {}, layers="1:"), tmp_path / "off", tokenizer=SavingTokenizer(),
                       progress=False)
    assert seen == [[0, 1], [1, 2], [2, 3]]  # receiver n and its donor n-1 (Lisa.rewires), nothing else


def test_one_decoder_layer_in_memory_at_a_time(tmp_path, monkeypatch):
    src = _checkpoint("llama", tmp_path / "src")
    most = []
    real_load = OffloadedLayers._load_layer

    def counting_load(self, i):
        real_load(self, i)
        most.append(sum(any(p.device.type != "meta" for p in block.parameters()) for block in self.layers))

    monkeypatch.setattr(OffloadedLayers, "_load_layer", counting_load)
    compress_offloaded(src, one_step("nbl", {"m": 2, "sequential": True}), tmp_path / "off",
                       tokenizer=SavingTokenizer(), progress=False)
    assert most and max(most) == 1


def test_a_shard_is_hashed_once_and_damage_is_named(tmp_path, monkeypatch):
    import attnslim.verify as shards

    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path / "cache"))  # where the stamps go
    src = _checkpoint("llama", tmp_path / "src")
    out = tmp_path / "off"
    compress_offloaded(src, one_step("svd", {"ratio": 0.5}), out, tokenizer=SavingTokenizer(), progress=False)
    calls = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: calls.append(p) or real(p))
    load(out)
    assert len(calls) == 5  # the first load hashes every shard once
    load(out)
    assert len(calls) == 5  # later loads check sizes only (a stamp in the cache records the file's identity)
    victim = out / "model-00002-of-00005.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8])
    with pytest.raises(AttnslimError, match="shard model-00002-of-00005.safetensors has"):
        load(out)


@pytest.mark.parametrize("method,args,match", [
    ("atp", {"recover": {"steps": 1}}, "atp.*trains"),
    ("lisa", {"train": {"steps": 1}}, "lisa.*trains"),
])
def test_what_cannot_run_offloaded_is_refused_without_output(method, args, match, tmp_path):
    src = _checkpoint("llama", tmp_path / "src")
    with pytest.raises(AttnslimError, match=match):
        compress_offloaded(src, one_step(method, args, layers="1:"), tmp_path / "off", tokenizer=SavingTokenizer(),
                           progress=False)
    assert not (tmp_path / "off").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temp directory left either


def test_heal_is_refused_offloaded(tmp_path):
    from attnslim.recipe import recipe_from_dict

    src = _checkpoint("llama", tmp_path / "src")
    recipe = recipe_from_dict({**_recipe_dict(one_step("svd", {"ratio": 0.5})), "heal": {"steps": 1}})
    with pytest.raises(AttnslimError, match="heal trains the whole model"):
        compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)


def _recipe_dict(recipe):
    from attnslim.recipe import recipe_to_dict

    return recipe_to_dict(recipe)


def test_missing_and_truncated_input_shards_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = _checkpoint("llama", tmp_path / "src")
    state = load_file(src / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(src / "model-00001-of-00002.safetensors"))
    (src / "model.safetensors").unlink()
    index = {"weight_map": {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    recipe = one_step("svd", {"ratio": 0.5})
    with pytest.raises(AttnslimError, match="shard model-00002-of-00002.safetensors is missing"):
        compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)
    save_file({k: state[k] for k in names[half:]}, str(src / "model-00002-of-00002.safetensors"))
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(AttnslimError, match="shard model-00002-of-00002.safetensors is damaged or truncated"):
        compress_offloaded(src, recipe, tmp_path / "off", tokenizer=SavingTokenizer(), progress=False)
    assert not (tmp_path / "off").exists()


def test_a_full_disk_is_refused_before_any_work(tmp_path, monkeypatch):
    import shutil

    import attnslim.offload.compute as compute

    src = _checkpoint("llama", tmp_path / "src")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(compute.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(AttnslimError, match="the output needs up to .* GiB free"):
        compress_offloaded(src, one_step("svd", {"ratio": 0.5}), tmp_path / "off", tokenizer=SavingTokenizer())
    assert not (tmp_path / "off").exists()


def test_offload_is_chosen_when_the_model_does_not_fit(tmp_path, monkeypatch):
    import attnslim.offload as offload
    from attnslim.models.load import load_skeleton

    size = model_bytes(load_skeleton(_checkpoint("llama", tmp_path / "src"))[0])
    recipe = one_step("svd", {"ratio": 0.5})
    methods = check_recipe(recipe)
    assert offload_reason(size, recipe, methods, torch.float32) is None
    monkeypatch.setattr(offload, "memory_available", lambda: 1000)
    assert "compressing with --offload" in offload_reason(size, recipe, methods, torch.float32)


def test_a_heal_that_does_not_fit_takes_a_bfloat16_teacher_and_checkpointing(tmp_path, monkeypatch):
    """Between 1.5 and 2 model copies of free memory (x 1.2), a default heal gets the lean settings, with the
    reason, and then needs no offload; below 1.5 copies nothing helps and offloading (which refuses heals) is chosen;
    a heal whose memory settings the recipe chose is never changed."""
    import attnslim.offload as offload
    from attnslim.models.load import load_skeleton

    src = _checkpoint("llama", tmp_path / "src")
    size = model_bytes(load_skeleton(src)[0])
    recipe = recipe_from_dict({**recipe_to_dict(one_step("svd", {"ratio": 0.5})), "heal": {"steps": 2}})
    methods = check_recipe(recipe)
    assert lean_heal(size, recipe, methods) is None  # it fits as it is
    monkeypatch.setattr(offload, "memory_available", lambda: int(size * 1.2 * 1.75))
    lean, why = lean_heal(size, recipe, methods)
    assert lean.heal == {**recipe.heal, "teacher_dtype": "bfloat16", "checkpoint": True}
    assert "healing with a bfloat16 teacher and activation checkpointing" in why
    assert offload_reason(size, lean, methods, torch.float32) is None
    assert offload_reason(size, recipe, methods, torch.float32)
    chosen = recipe_from_dict({**recipe_to_dict(recipe), "heal": {"steps": 2, "checkpoint": True}})
    assert lean_heal(size, chosen, methods) is None
    monkeypatch.setattr(offload, "memory_available", lambda: int(size * 1.2 * 1.25))
    assert lean_heal(size, recipe, methods) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    from attnslim.cli import main

    assert main(["compress", "--recipe", "svd", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
    assert "--device cuda: no CUDA GPU is available here" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_dtype_and_device_names():
    from attnslim.offload.compute import parse_dtype, resolve_device

    with pytest.raises(AttnslimError, match="--dtype 'int8' is not supported; valid: float32, bfloat16, float16"):
        parse_dtype("int8")
    with pytest.raises(AttnslimError, match="only cpu and cuda"):
        resolve_device("mps")


def test_a_dtype_the_device_cannot_run_is_refused(monkeypatch):
    from attnslim.offload import compute

    def broken(*args, **kwargs):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(compute.torch.nn.functional, "linear", broken)
    with pytest.raises(AttnslimError, match="--dtype float16 cannot run on cpu"):
        compute.check_dtype(torch.device("cpu"), torch.float16)


REAL_CASES = [  # (method, args, layers, calibration windows of 128 tokens): one per kind of step: factorised
    ("latentllm", {"ratio": 0.8}, "0:3", 2),  # linears, a new attention module, a layer selection, a rewired
    ("mla", {"kv_ratio": 0.5}, "0:3", 2),  # donor, a projection of the keys
    ("nbl", {"m": 1}, "0:3", 5),  # its 576x576 covariance needs > 576 tokens
    ("lisa", {}, "1:3", 2),
    ("atp", {}, "0:3", 2),
]


@pytest.mark.real
@pytest.mark.parametrize("method,args,layers,windows", REAL_CASES, ids=[c[0] for c in REAL_CASES])
def test_smollm2_offloaded_equals_in_memory(method, args, layers, windows, tmp_path):
    from attnslim.api import compress_to
    from attnslim.recipe import recipe_from_dict

    recipe = recipe_from_dict({
        "name": "offload-check", "calibration": {"source": "wiki", "windows": windows, "seq_len": 128, "seed": 0},
        "steps": [{"method": method, "layers": layers, "args": args}],
    })
    compress_to("smollm2-135m", recipe, tmp_path / "mem", progress=False)
    compress_to("smollm2-135m", recipe, tmp_path / "off", offload=True, progress=False)
    assert_same_weights(_weights(tmp_path / "mem"), _weights(tmp_path / "off"))
