"""One matrix of every method on the tiny families: save -> load gives the compressed model's logits with both
loaders (attnslim.io.load and transformers' trust_remote_code entry), and the reloaded model generates the same
greedy tokens with and without its KV cache, dynamic or static (`cache_implementation="static"`: one preallocated
buffer per layer, returned whole, its unfilled rows masked). Per-method files test what is specific to a method."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from attnslim.api import compress
from conftest import TINY_BUILDERS
from helpers import ByteTokenizer, assert_cache_kinds_match, one_step, reloaded_with_both_loaders

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
GEMMA_RANKS = {"q": 24, "k": 16, "v": 12, "o": 24, "gate": 40, "up": 40, "down": 40}  # MQA: k is 16 = head_dim
MATRIX = [  # (family, method, args)
    ("llama", "svd", {"ratio": 0.5}),
    ("opt", "asvd", {"ratio": 0.5}),
    ("llama", "svdllm", {"ratio": 0.5}),
    ("llama", "drop", {"count": 2}),
    ("qwen2", "latentllm", {"ratio": 0.7, "mlp": "joint_ud"}),
    ("opt", "latentllm", {"ratio": 0.7, "vo": "joint"}),
    ("gemma3", "latentllm", {"ratio": None, "ranks": GEMMA_RANKS, "mlp": "local"}),
    # one slot a latent, the other per KV head (keys latent, values dense; keys dense, values latent)
    ("llama", "latentllm", {"ratio": None, "ranks": {"q": 64, "k": 16, "v": 32, "o": 64}}),
    ("llama", "latentllm", {"ratio": None, "ranks": {"q": 64, "k": 32, "v": 16, "o": 64}, "cache": "values"}),
    ("qwen2", "mla", {"kv_ratio": 0.5}),
    ("llama", "transmla", {"kv_ratio": 0.5}),
    ("opt", "mla", {"kv_ratio": 0.5, "rope_dims": 0}),
    ("gemma3", "mla", {"kv_ratio": 0.5}),  # QK-norm: key scales cached beside the latent, sliding layers
    ("llama", "nbl", {"m": 2}),
    ("llama", "nbl", {"m": 2, "input": "residual", "sequential": True}),
    ("mistral", "nbl", {"m": 1}),
    ("llama", "lisa", {}),
    ("llama", "ds", {}),
]


@pytest.mark.parametrize("family,method,args", MATRIX, ids=[f"{f}-{m}-{i}" for i, (f, m, _) in enumerate(MATRIX)])
def test_save_load_identical_logits_and_cached_generation(family, method, args, tmp_path):
    model = TINY_BUILDERS[family]()
    layers = [2, 3] if method in ("lisa", "ds") else "all"  # sharing needs a previous layer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny calibration sets are rank-deficient by design
        report = compress(model, ByteTokenizer(), one_step(method, args, layers=layers), progress=False)
    loaded = reloaded_with_both_loaders(model, report.to_json(), tmp_path / "m", IDS)
    cached = loaded.generate(IDS[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    uncached = loaded.generate(IDS[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0  # left padding in the second row
    assert_cache_kinds_match(loaded, IDS, mask)


def _saved(family, method, args, directory):
    from attnslim.io import save
    from helpers import SavingTokenizer

    model = TINY_BUILDERS[family]()
    layers = [2, 3] if method in ("lisa", "ds") else "all"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, ByteTokenizer(), one_step(method, args, layers=layers), progress=False)
    return save(model, SavingTokenizer(), directory, report.to_json())


@pytest.mark.parametrize("family,method,args", MATRIX, ids=[f"{f}-{m}-{i}" for i, (f, m, _) in enumerate(MATRIX)])
def test_every_output_reads_through_inspect_bench_report_and_eval(family, method, args, tmp_path, capsys):
    """The commands a user runs on an output, each on every method's output (reliability round 3, F5: inspect and
    bench once failed on every svd/asvd/svdllm output because they read a dense spec from factored linears)."""
    from attnslim.cli import main
    from helpers import SavingTokenizer

    out = _saved(family, method, args, tmp_path / "m")
    dense = tmp_path / "dense"
    TINY_BUILDERS[family]().save_pretrained(dense)
    SavingTokenizer().save_pretrained(dense)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    n_layers = TINY_BUILDERS[family]().config.num_hidden_layers
    assert all(f"\n{i:>5}  " in printed for i in range(n_layers)), printed
    assert main(["bench", str(out), "--vs", str(dense), "--device", "cpu", "--contexts", "8", "--new-tokens", "2",
                 "--repeats", "1", "--json"]) == 0
    bench = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert str(out) in json.dumps(bench) and str(dense) in json.dumps(bench)
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").stat().st_size > 0 and (out / "report.md").stat().st_size > 0
    assert main(["eval", str(out), "--data", "tiny", "--tokens", "64", "--seq-len", "32", "--json"]) == 0
    ppl = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"]["tiny"]
    assert math.isfinite(ppl) and ppl > 1.0
