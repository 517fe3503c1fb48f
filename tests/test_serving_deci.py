"""Stock vLLM serves `attnslim export --to deci` of SmolLM2's drop-6 with its own DeciLMForCausalLM, as attnslim's HF
model runs the drop-6 output (marker `serving`: `make test-serve`).

No attnslim plugin: the offline driver runs vLLM with VLLM_PLUGINS empty (no general plugin loads, in any of its
processes) and --trust-remote-code for the export's config class only; the model class vLLM reports is its own.
Same prompts, dtype and KV space as tests/test_serving.py (tests/serving_helpers.py), dense SmolLM2 beside the
export in one vLLM process for the KV-capacity ratio; `attnslim serve` on the export answers the `openai` client.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving_helpers import MAX_TOKENS, offline, perplexity, wiki_prompts

pytestmark = pytest.mark.serving
LAYERS, DROPPED = 30, 6  # SmolLM2-135M and the drop-6 variant


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return wiki_prompts()


@pytest.fixture(scope="session")
def deci(tmp_path_factory) -> dict[str, Path]:
    """dense and drop-6 (serving/variants.py) and drop-6 exported by the CLI to out/deci."""
    from attnslim.serving.variants import build

    root = tmp_path_factory.mktemp("deci")
    dirs = {name: build(name, root / name) for name in ("dense", "drop-6")}
    dirs["deci"] = root / "deci"
    done = subprocess.run([sys.executable, "-m", "attnslim", "export", str(dirs["drop-6"]), "--to", "deci", "--out",
                           str(dirs["deci"])], capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    return dirs


@pytest.fixture(scope="session")
def deci_runs(deci, prompts, tmp_path_factory) -> dict[str, dict]:
    results = offline(tmp_path_factory.mktemp("vllm-deci"), [str(deci["dense"]), str(deci["deci"])], prompts,
                       trust_remote_code=True, plugins=[])
    return {name: results[str(deci[name])] for name in ("dense", "deci")}


def test_stock_vllm_serves_the_export_with_its_own_model_and_no_plugin(deci_runs):
    assert deci_runs["deci"]["architecture"] == "DeciLMForCausalLM"
    assert deci_runs["dense"]["architecture"] == "LlamaForCausalLM"
    assert deci_runs["deci"]["general_plugins"] == [] == deci_runs["dense"]["general_plugins"]


def test_greedy_tokens_and_prompt_perplexity_equal_attnslims_model(deci, deci_runs, prompts):
    from attnslim.serving.reference import reference

    hf = reference(str(deci["drop-6"]), prompts, MAX_TOKENS)  # attnslim.load's model: DroppedAttention layers
    ours = deci_runs["deci"]["correctness"]
    for i, (a, b) in enumerate(zip(ours["greedy"], hf["greedy"], strict=True)):
        assert len(a) == len(b) == MAX_TOKENS
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i}: vLLM and HF differ from new token {first} ({a[first]} vs {b[first]})"
    ratio = perplexity(ours["prompt_logprobs"]) / perplexity(hf["prompt_logprobs"])
    print(f"deci export: prompt perplexity vLLM / HF {ratio:.6f}")
    assert abs(ratio - 1) < 0.01


def test_dropped_layers_hold_no_kv_cache_in_vllm(deci_runs):
    """Same VLLM_CPU_KVCACHE_SPACE: 24 of 30 layers with a cache fit 30/24 times the dense tokens (to a block)."""
    dense, ours = deci_runs["dense"], deci_runs["deci"]
    assert ours["block_size"] == dense["block_size"]
    print(f"deci export: {ours['kv_blocks']} KV blocks, dense {dense['kv_blocks']}: "
          f"{ours['kv_blocks'] / dense['kv_blocks']:.4f}x (expected {LAYERS / (LAYERS - DROPPED):.4f})")
    assert abs(ours["kv_blocks"] - dense["kv_blocks"] * LAYERS / (LAYERS - DROPPED)) <= 1, (ours, dense)


def test_attnslim_serve_runs_the_export_over_loopback(deci, prompts, tmp_path):
    """`attnslim serve OUT` starts vLLM on the export (with --trust-remote-code for attnslim's own config class):
    the `openai` client gets attnslim's greedy tokens."""
    import openai

    from attnslim.serving.probe import free_port, wait_ready
    from attnslim.serving.reference import reference

    expected = reference(str(deci["drop-6"]), prompts[:1], 16)["greedy"][0]
    port, log = free_port(), tmp_path / "server.log"
    argv = [sys.executable, "-m", "attnslim", "serve", str(deci["deci"]), "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--kv-cache-gib", "1", "--enforce-eager"]
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.completions.create(model=str(deci["deci"]), prompt=prompts[0], max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
        assert reply.choices[0].token_ids == expected, log.read_text()[-4000:]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=120)
