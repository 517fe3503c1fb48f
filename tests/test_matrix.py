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
    # the r²-saving junctions that structure B (LatentAttention decompresses keys and values through them)
    ("llama", "latentllm", {"ratio": 0.7, "junction": "lu", "mlp": "local"}),
    ("opt", "latentllm", {"ratio": 0.7, "junction": "left_block_identity", "vo": "joint"}),
    ("gemma3", "latentllm", {"ratio": None, "ranks": GEMMA_RANKS, "junction": "lu", "cache": "values"}),
    # the paper's ablation forms (App. C, D): one shared q/k/v latent (biases; QK-norm and sliding layers), and
    # split-head q/k with block-diagonal B (the key latent decompressed, on OPT absorbed, through the blocks)
    ("qwen2", "latentllm", {"ratio": 0.7, "qk": "joint_qkv", "cache": "dense"}),
    ("gemma3", "latentllm", {"ratio": 0.7, "qk": "joint_qkv", "cache": "dense", "junction": "lu"}),
    ("llama", "latentllm", {"ratio": 0.7, "qk": "split_head", "alloc": "uniform"}),
    ("opt", "latentllm", {"ratio": 0.7, "qk": "split_head", "alloc": "uniform"}),
    ("qwen2", "mla", {"kv_ratio": 0.5}),
    ("llama", "transmla", {"kv_ratio": 0.5}),
    ("opt", "mla", {"kv_ratio": 0.5, "rope_dims": 0}),
    ("gemma3", "mla", {"kv_ratio": 0.5}),  # QK-norm: key scales cached beside the latent, sliding layers
    ("llama", "nbl", {"m": 2}),
    ("llama", "nbl", {"m": 2, "input": "residual", "sequential": True}),
    ("mistral", "nbl", {"m": 1}),
    ("opt", "nbl", {"m": 1}),
    ("gemma3", "nbl", {"m": 1}),  # the fit target before the post-attention norm, scores after it
    ("llama", "lisa", {}),
    ("llama", "ds", {}),
    ("opt", "lisa", {}),
    ("opt", "ds", {}),
    ("mistral", "lisa", {}),  # every layer slides: donor and receiver share the window
    ("mistral", "ds", {}),
    ("qwen3", "mla", {"kv_ratio": 0.5}),  # QK-norm with a plain gain: key scales cached beside the latent
    ("qwen3", "latentllm", {"ratio": 0.7}),
    ("qwen3", "nbl", {"m": 1}),
    ("qwen3", "lisa", {}),  # the donor's q/k (QK-normed) give the scores
    ("qwen3", "ds", {}),
    ("llama3", "mla", {"kv_ratio": 0.5}),  # the decoupled rotary key on the model's scaled frequencies
    ("llama3", "latentllm", {"ratio": 0.7, "rope_window": 4}),  # the RoPE-aware fit on the scaled frequencies
    ("llama3", "lisa", {}),
    # fused qkv_proj / gate_up_proj split by the adapter: every part factored (saved split), the MLP's gate/up
    # compressed jointly, whole-attention replacements beside a split MLP that saves fused
    ("phi3", "svd", {"ratio": 0.5}),
    ("phi3", "latentllm", {"ratio": 0.7, "mlp": "joint_ud"}),
    ("phi3", "mla", {"kv_ratio": 0.5}),
    ("phi3", "nbl", {"m": 1}),
    ("phi3", "lisa", {}),
    ("phi3", "ds", {}),
]
ROWS = {(family, method) for family, method, _ in MATRIX}
# every (family, method) pair without a row, with the reason; a new method or family fails
# test_matrix_covers_every_method_on_every_family until it has rows or reasons here
_PER_LINEAR = ("per-linear factorisation (LowRankLinear) of the adapter's canonical linears, the same module on "
               "every family; svdllm saves, loads and generates on every family in tests/test_pipeline.py::"
               "test_every_family_compresses_saves_and_generates")
_DROP = ("the layer's attention removed (the same module on every family); drop saves, loads and generates on every "
         "family in tests/test_pipeline.py::test_every_family_compresses_saves_and_generates")
_MLA_MODULE = ("builds the MLAAttention that mla builds (methods/mla_base.py), whose family rows are mla's; its fit "
               "on every family: tests/test_mla.py::test_full_rank_with_every_rotary_dim_reproduces_dense_logits")
_ATP = ("ATP does not keep cached = uncached generation by design (paper form: non-causal, refuses to generate; "
        "serving form: the cached prompt is compressed, the uncached one is not); its save/load: "
        "tests/test_atp.py::test_save_load_identical_logits")
_GEMMA_SHARING = ("the tiny Gemma-3 alternates sliding and full layers, so no layer's donor (layer n-1) has its "
                  "attention span, which sharing refuses with a clear error")
_QWEN_SHARING = ("the matrix shares layers 2-3, and tiny Qwen2's layer 1 (full) cannot donate to layer 2 (sliding); "
                 "lisa on its layer 3: tests/test_lisa.py::test_other_families_cache_and_nf")
SKIPS: dict[tuple[str, str], str] = {
    **{(f, m): _PER_LINEAR for m in ("svd", "asvd", "svdllm") for f in TINY_BUILDERS if (f, m) not in ROWS},
    **{(f, "drop"): _DROP for f in TINY_BUILDERS if (f, "drop") not in ROWS},
    **{(f, "transmla"): _MLA_MODULE for f in TINY_BUILDERS if (f, "transmla") not in ROWS},
    **{(f, "atp"): _ATP for f in TINY_BUILDERS},
    ("llama", "mla"): "llama is transmla's row: the same MLAAttention on the same layout",
    ("mistral", "mla"): "mistral's sliding window in every layer: tests/test_mla.py's full-rank and fused-decode "
                        "tests run mla on mistral",
    ("mistral", "latentllm"): "cached = uncached on mistral: tests/test_latentllm.py::"
                              "test_latent_cache_is_smaller_and_cached_equals_uncached",
    ("qwen2", "nbl"): "Qwen2's block has Llama's norms around it, and NBL replaces the whole attention block by a map "
                      "of its input, so q/k/v biases and sliding windows do not reach it",
    ("gemma3", "lisa"): _GEMMA_SHARING,
    ("gemma3", "ds"): _GEMMA_SHARING,
    ("qwen2", "lisa"): _QWEN_SHARING,
    ("qwen2", "ds"): _QWEN_SHARING + " (not ds: ds on Qwen2 is not covered)",
    ("llama3", "nbl"): "NBL replaces the attention block by a linear map of its input: no RoPE reaches it, so rope "
                       "scaling changes nothing; llama's rows cover its layout",
    ("llama3", "ds"): "ds reuses the donor's attention scores, computed with the model's own (scaled) rotary "
                      "module; llama3's lisa row runs the same sharing path and llama's ds row the layout",
}


def test_matrix_covers_every_method_on_every_family():
    """Every registered method on every tiny family has a row or a reason, never both, and nothing else is listed."""
    from attnslim.methods import METHODS

    pairs = {(family, method) for family in TINY_BUILDERS for method in METHODS}
    assert ROWS | set(SKIPS) == pairs, f"no row and no reason: {sorted(pairs - ROWS - set(SKIPS))}; " \
        f"neither a method nor a family: {sorted((ROWS | set(SKIPS)) - pairs)}"
    assert ROWS & set(SKIPS) == set(), f"a row and a reason: {sorted(ROWS & set(SKIPS))}"
    assert all(reason.strip() for reason in SKIPS.values())


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
