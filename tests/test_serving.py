"""vLLM serves dense SmolLM2, its NBL-6 and drop-6 outputs, the planner's vLLM model at KV 0.25 (`attnslim compress
--kv 0.25 --engine vllm` on less text: keep/nbl/drop per layer) and the DeepSeek-V3 export of its MLA conversion as
HF runs them (marker `serving`: `make test-serve`).

One offline vLLM process serves the Llama-family variants in turn (each model starts once per session), a second
one the DeepSeek-V3 export (vLLM's reference CPU_MLA backend: its AMX one, chosen where the CPU has AMX, runs
bfloat16 only); the HF side runs here, with transformers' own DeepseekV3ForCausalLM for the export. float32 on both
sides, 8 wiki prompts of 96 tokens, 64 greedy tokens each (no EOS stop on either side).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from attnslim.errors import AttnslimError
from attnslim.serving.probe import free_port, wait_ready
from serving_helpers import KV_GIB, MAX_TOKENS, PROMPT_LEN, offline, perplexity, wiki_prompts

pytestmark = pytest.mark.serving

LLAMA_VARIANTS = ("dense", "nbl-6", "drop-6", "plan-vllm-kv0.25")
MLA_VARIANTS = ("mla-deepseek",)
VARIANTS = LLAMA_VARIANTS + MLA_VARIANTS


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> dict[str, Path]:
    """Every variant as serving/variants.py builds it, but the planned one planned on less than `compress --kv 0.25
    --engine vllm`'s defaults: 8 fit windows of 256 tokens, 2 scoring windows, one refinement round, and only the
    kinds attnslim's vLLM plugin serves (keep, nbl, drop; the 320-wide MLA candidate the full-size plan also weighs
    needs 55 windows for the output refit). A mixed keep/nbl/drop model all the same,
    minutes faster: what is checked here (vLLM equals HF on the same weights, the KV capacity follows the cached
    layers) does not depend on how well the plan was chosen; benchmarks/serve.py serves the full-size plan."""
    from attnslim.planner.output import plan_and_compress
    from attnslim.planner.run import PlanConfig
    from attnslim.recipe import Calibration
    from attnslim.serving.variants import MODEL, build

    root = tmp_path_factory.mktemp("served")
    out = {name: build(name, root / name) for name in VARIANTS if name != "plan-vllm-kv0.25"}
    quick = PlanConfig(kv=0.25, engine="vllm", kinds=("keep", "nbl", "drop"), score_windows=2, refine_windows=2,
                       rounds=1, calibration=Calibration(source="wiki", windows=8, seq_len=256))
    plan_and_compress(MODEL, quick, root / "plan-vllm-kv0.25", progress=False)
    return out | {"plan-vllm-kv0.25": root / "plan-vllm-kv0.25"}


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return wiki_prompts()


@pytest.fixture(scope="session")
def vllm_runs(served, prompts, tmp_path_factory) -> dict[str, dict]:
    results = offline(tmp_path_factory.mktemp("vllm"), [str(served[n]) for n in LLAMA_VARIANTS], prompts)
    results |= offline(tmp_path_factory.mktemp("vllm-mla"), [str(served[n]) for n in MLA_VARIANTS], prompts,
                        attention_backend="CPU_MLA")
    return {name: results[str(served[name])] for name in VARIANTS}


@pytest.fixture(scope="session")
def hf_runs(served, prompts) -> Callable[[str], dict]:
    """The HF results of one variant, computed on first use (the loopback test needs only NBL-6's)."""
    from attnslim.serving.reference import reference

    return cache(lambda name: reference(str(served[name]), prompts, MAX_TOKENS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_equal_hf(variant, vllm_runs, hf_runs):
    ours, theirs = vllm_runs[variant]["correctness"]["greedy"], hf_runs(variant)["greedy"]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert len(a) == len(b) == MAX_TOKENS
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i}: vLLM and HF differ from new token {first} ({a[first]} vs {b[first]})"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_perplexity_within_one_percent_of_hf(variant, vllm_runs, hf_runs):
    ours = perplexity(vllm_runs[variant]["correctness"]["prompt_logprobs"])
    theirs = perplexity(hf_runs(variant)["prompt_logprobs"])
    assert len(vllm_runs[variant]["correctness"]["prompt_logprobs"][0]) == PROMPT_LEN - 1
    print(f"{variant}: perplexity vLLM {ours:.4f}, HF {theirs:.4f}, ratio {ours / theirs:.6f}")
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)


# Layers with a KV cache, (fewest, most) of 30: NBL-6 and drop-6 remove 6; the plan at KV 0.25 keeps at most
# floor(0.25 * 30) = 7, its budget (how many it keeps is the planner's choice).
CACHED_LAYERS = {"nbl-6": (24, 24), "drop-6": (24, 24), "plan-vllm-kv0.25": (1, 7)}


def test_layers_without_attention_hold_no_kv_cache(served, vllm_runs):
    """Same VLLM_CPU_KVCACHE_SPACE: C of 30 layers with a cache fit 30/C times the dense tokens (to a block); C is
    read from each output's compression.json."""
    from attnslim.serving.plan import layer_kinds

    assert set(CACHED_LAYERS) == set(LLAMA_VARIANTS[1:])
    dense = vllm_runs["dense"]
    for variant, (fewest, most) in CACHED_LAYERS.items():
        cached = sum(kind.has_kv_cache for kind in layer_kinds(served[variant]))
        assert fewest <= cached <= most, (variant, cached)
        run = vllm_runs[variant]
        assert run["block_size"] == dense["block_size"]
        assert abs(run["kv_blocks"] - dense["kv_blocks"] * 30 / cached) <= 1, (variant, run["kv_blocks"], dense)


def test_the_deepseek_export_caches_its_latent_and_rotary_key_only(served, vllm_runs):
    """Same VLLM_CPU_KVCACHE_SPACE and dtype: vLLM's MLA cache holds kv_lora_rank + qk_rope_head_dim values per token
    and layer (512 + 64 here, the CPU kernel's one size) where dense SmolLM2 holds 2 · n_kv · d_h = 384, so it
    fits 384 / 576 of the dense tokens (to a block). On this model the padded latent is larger than the dense cache;
    vLLM's GPU MLA backends also take 320 (256 + 64: 0.83 of this model's dense cache) and 512 (docs/serving.md)."""
    config = json.loads((served["mla-deepseek"] / "config.json").read_text())
    base = json.loads((served["dense"] / "config.json").read_text())
    per_token = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    dense_per_token = 2 * base["num_key_value_heads"] * (base.get("head_dim")
                                                         or base["hidden_size"] // base["num_attention_heads"])
    dense, mla = vllm_runs["dense"], vllm_runs["mla-deepseek"]
    expected = dense["kv_tokens"] * dense_per_token / per_token
    assert abs(mla["kv_tokens"] - expected) <= max(mla["block_size"], dense["block_size"]), (mla, dense, per_token)


def test_openai_client_over_loopback_gets_hf_greedy_tokens(served, prompts, hf_runs, tmp_path):
    """`attnslim serve` (127.0.0.1, API key from --api-key-file) answers the `openai` client with HF's greedy
    tokens; a wrong key is refused."""
    import openai

    port, key, log = free_port(), "test-key-21", tmp_path / "server.log"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    argv = [sys.executable, "-m", "attnslim", "serve", str(served["nbl-6"]), "--port", str(port), "--api-key-file",
            str(key_file), "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gib", KV_GIB, "--enforce-eager"]
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/health", timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=300)
        for ids, expected in zip(prompts[:2], hf_runs("nbl-6")["greedy"][:2], strict=True):
            reply = client.completions.create(model=str(served["nbl-6"]), prompt=ids, max_tokens=16, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
            assert reply.choices[0].token_ids == expected[:16]
        wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=str(served["nbl-6"]), prompt="Hello", max_tokens=1)
    except (AssertionError, AttnslimError):
        raise AssertionError(log.read_text()[-4000:]) from None
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=120)
