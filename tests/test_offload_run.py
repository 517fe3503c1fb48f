"""Running offloaded models (`eval` / `generate` / `bench` --offload): the decoder layers stay on disk, read by
accelerate hooks while they run; logits and greedy generations equal the in-memory model's."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnslim.api import compress
from attnslim.io import load, save
from attnslim.models import load_model
from conftest import TINY_BUILDERS
from helpers import ByteTokenizer, SavingTokenizer, one_step

CASES = [  # family, method, args: a replaced attention of each kind that reads its children's weights
    ("llama", "mla", {"kv_ratio": 0.5}),
    ("llama", "nbl", {"m": 1}),
    ("llama", "latentllm", {"ratio": 0.6}),
    ("opt", "svdllm", {"ratio": 0.5}),
    ("gemma3", "latentllm", {"ratio": 0.6}),
    ("llama", "lisa", {}),  # layers 1-3 read their donor's scores through links the skeletons rebuild
    ("mistral", "ds", {}),
]
LAYERS = {"lisa": "1:", "ds": "1:"}  # sharing needs a donor below
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _saved(family: str, method: str, args: dict, out) -> None:
    model = TINY_BUILDERS[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, ByteTokenizer(), one_step(method, args, layers=LAYERS.get(method, "all")),
                          progress=False)
    save(model, SavingTokenizer(), out, report.to_json())


@pytest.mark.parametrize("family,method,args", CASES, ids=[f"{f}-{m}" for f, m, _ in CASES])
def test_offloaded_run_equals_in_memory(family, method, args, tmp_path):
    _saved(family, method, args, tmp_path / "out")
    memory, _ = load(tmp_path / "out")
    offloaded, _ = load(tmp_path / "out", offload=True)
    layers = offloaded.model.layers if family != "opt" else offloaded.model.decoder.layers
    assert all(p.device.type == "meta" for p in layers.parameters())  # on disk between forwards
    with torch.no_grad():
        assert torch.equal(memory(input_ids=IDS).logits, offloaded(input_ids=IDS).logits)
        ref = memory.generate(IDS[:1], max_new_tokens=6, do_sample=False)
        assert torch.equal(offloaded.generate(IDS[:1], max_new_tokens=6, do_sample=False), ref)
    assert all(p.device.type == "meta" for p in layers.parameters())
    mla = [m for m in offloaded.modules() if type(m).__name__ == "MLAAttention"]
    assert all(m._fused is None and m._absorbed is None for m in mla)  # no derived copy per layer kept


def test_a_plain_checkpoint_runs_offloaded(tmp_path):
    TINY_BUILDERS["llama"]().save_pretrained(tmp_path / "ckpt")
    SavingTokenizer().save_pretrained(tmp_path / "ckpt")
    memory, _ = load_model(str(tmp_path / "ckpt"))
    offloaded, _ = load_model(str(tmp_path / "ckpt"), offload=True)
    with torch.no_grad():
        assert torch.equal(memory(input_ids=IDS).logits, offloaded(input_ids=IDS).logits)


def test_cli_generate_and_bench_take_offload(tmp_path, capsys):
    from attnslim.cli import main

    _saved("llama", "nbl", {"m": 1}, tmp_path / "out")
    texts = []
    for extra in ([], ["--offload"]):
        assert main(["generate", str(tmp_path / "out"), "--prompt", "A", "--max-new-tokens", "8", "--device", "cpu",
                     *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert main(["bench", str(tmp_path / "out"), "--offload", "--contexts", "8", "--new-tokens", "2",
                 "--repeats", "1"]) == 0
    assert "decode" in capsys.readouterr().out


def test_offload_of_a_hub_id_is_refused():
    from attnslim.errors import AttnslimError

    with pytest.raises(AttnslimError, match="--offload reads local safetensors files"):
        load_model("someorg/somemodel", offload=True)


@pytest.mark.real
def test_real_smollm2_offloaded_run_equals_in_memory():
    """The packaged model (tied embeddings, 30 layers) offloaded: same logits, same greedy continuation."""
    memory, tokenizer = load_model("smollm2-135m")
    offloaded, _ = load_model("smollm2-135m", offload=True)
    ids = tokenizer("The history of the city begins", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(memory(input_ids=ids).logits, offloaded(input_ids=ids).logits)
        ref = memory.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(offloaded.generate(ids, max_new_tokens=8, do_sample=False), ref)
