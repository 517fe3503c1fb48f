"""Offloaded compression at Llama-3-8B shapes: peak RSS, seconds per layer, output size (issue 22, item 4); and
`plan --offload` (method `plan`: issue 45's bounded-memory target).

Writes random-weight bf16 checkpoints with Llama-3-8B shapes (hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab
128256) and `--depths` decoder layers (the full model has 32), then compresses each with `compress --offload
--dtype bfloat16` in a fresh process per run, so each run's peak RSS is its own. RANDOM WEIGHTS SAY NOTHING ABOUT
QUALITY: this measures memory and time only; quality is measured on the real models (BENCHMARKS.md).
peak_rss_mb is ru_maxrss (anonymous + file-backed pages); peak_anon_rss_mb and peak_file_rss_mb split it (sampled):
the memory-mapped checkpoint pages count in the first and grow with the layers read, but the kernel reclaims them.

    .venv/bin/python benchmarks/scale.py --depths 2,4 --work /tmp/attnslim-scale
writes benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment  # noqa: E402

SHAPES: dict[str, Any] = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "intermediate_size": 14336, "vocab_size": 128256, "head_dim": 128}
SHAPES_70B: dict[str, Any] = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
                              "intermediate_size": 28672, "vocab_size": 128256, "head_dim": 128, "layers": 80}
RECIPES = {  # method -> (args, steps' layers); nbl picks m of the candidates
    # qk split: the joint-QK Tucker did not finish one 4096-wide layer in 22 minutes on 2 cores
    "latentllm": {"ratio": 0.8, "qk": "split", "vo": "separate", "mlp": "none", "cache": "latent"},
    "nbl": {"m": 1, "criterion": "similarity", "input": "normed"},
    "mla": {"kv_ratio": 0.5, "rope_select": "query", "kv_weight": "attention"},
}


def write_checkpoint(directory: Path, layers: int, seed: int = 0) -> None:
    """A Llama checkpoint of random bf16 weights, one shard per decoder layer, and the packaged tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from attnslim.models.load import checkpoint_directory

    directory.mkdir(parents=True)
    config = LlamaConfig(**SHAPES, num_hidden_layers=layers,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, max_position_embeddings=8192,
                         tie_word_embeddings=False, dtype="bfloat16")
    config.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ids < 49152 < vocab: any tokenizer of that size does
        shutil.copy(checkpoint_directory("smollm2-135m") / name, directory / name)
    gen = torch.Generator().manual_seed(seed)
    d, kv, ffn = SHAPES["hidden_size"], SHAPES["num_key_value_heads"] * SHAPES["head_dim"], SHAPES["intermediate_size"]
    weight_map = {}

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    n = layers + 1
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        state = {p + "self_attn.q_proj.weight": rand(d, d), p + "self_attn.k_proj.weight": rand(kv, d),
                 p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, d),
                 p + "mlp.gate_proj.weight": rand(ffn, d), p + "mlp.up_proj.weight": rand(ffn, d),
                 p + "mlp.down_proj.weight": rand(d, ffn), p + "input_layernorm.weight": torch.ones(d).bfloat16(),
                 p + "post_attention_layernorm.weight": torch.ones(d).bfloat16()}
        save_file(state, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, shard))
        del state
    shard = f"model-{n:05d}-of-{n:05d}.safetensors"
    vocab = SHAPES["vocab_size"]
    state = {"model.embed_tokens.weight": rand(vocab, d), "lm_head.weight": rand(vocab, d),
             "model.norm.weight": torch.ones(d).bfloat16()}
    save_file(state, str(directory / shard), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(state, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class RssSampler:
    """Peak anonymous and file-backed resident memory, sampled from /proc/self/status every 50 ms. ru_maxrss counts
    both: the checkpoint's memory-mapped pages, which the kernel can drop at any time, grow with every layer read
    and are not memory the run needs; the anonymous peak is (tensors, statistics, activations)."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]))  # kB

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"peak_anon_rss_mb": round(self.peak["RssAnon"] / 1024, 1),
                "peak_file_rss_mb": round(self.peak["RssFile"] / 1024, 1)}


# `plan`: `attnslim plan --offload --kv 0.5` (the API call) with the candidates that fit the calibration a
# random-weight run can afford at these shapes: mla at two widths without its output refit (the refit's token rule
# asks ~24 tokens per input dimension, 98k at hidden 4096), drop and keep; nbl's 4096 x 4096 map needs as many
# calibration tokens (a 100 s layer forward each here), so it is left out of this memory run.
PLAN_KINDS, PLAN_LADDER = ("keep", "mla", "drop"), (0.25, 0.5)
PLAN_MLA: dict[str, Any] = {"refit_o": False, "rope_select": "query", "kv_weight": "attention"}


def plan_child(src: Path, windows: int, seq_len: int) -> dict[str, Any]:
    """`plan --offload` in this process: peak memory, seconds, what the bank spilled to disk."""
    from attnslim.calib.runner import LayerRunner
    from attnslim.methods import lookup_method
    from attnslim.planner.output import offloaded_for_plan
    from attnslim.planner.run import PlanConfig, plan_model
    from attnslim.recipe import Calibration

    spent = {"calibration": 0.0, "conversion": 0.0}
    LayerRunner.run_layer = _timed(LayerRunner.run_layer, spent, "calibration")  # type: ignore[method-assign]
    cls = lookup_method("mla")
    cls.convert = _timed(cls.convert, spent, "conversion")  # type: ignore[method-assign]
    cfg = PlanConfig(kv=0.5, kinds=PLAN_KINDS, ladder=PLAN_LADDER, mla_args=PLAN_MLA, score_windows=2,
                     refine_windows=2, rounds=1,
                     calibration=Calibration(source="wiki", windows=windows, seq_len=seq_len, batch_size=2))
    sampler = RssSampler()
    start = time.perf_counter()
    with offloaded_for_plan(str(src), "bfloat16") as (model, tokenizer, residency):
        result = plan_model(model, tokenizer, cfg, progress=False, residency=residency)
    seconds = time.perf_counter() - start
    rss = sampler.stop()
    report = result.report
    return {"seconds": round(seconds, 1), "calibration_s": round(spent["calibration"], 1),
            "conversion_s": round(spent["conversion"], 1),
            "converted_layers": [r["layer"] for r in report["layers"] if r["choice"] != "keep"],
            "mla_candidates": len(PLAN_LADDER) * len(report["layers"]),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), **rss,
            "output_bytes": 0, "bank_mb": round(report["bank_mb"], 1), "plan": [r["choice"] for r in report["layers"]],
            "plan_seconds": report["seconds"],
            "plan_config": {"kinds": list(PLAN_KINDS), "ladder": list(PLAN_LADDER), "mla_args": PLAN_MLA}}


def _timed(fn: Any, spent: dict[str, float], key: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return wrapper


def child(src: Path, out: Path, method: str, windows: int, seq_len: int, m: int) -> dict[str, Any]:
    """One offloaded compression in this process, with calibration (layer forwards) and conversion timed apart."""
    from attnslim.api import compress_offloaded
    from attnslim.calib.runner import LayerRunner
    from attnslim.methods import lookup_method
    from attnslim.recipe import recipe_from_dict

    spent = {"calibration": 0.0, "conversion": 0.0}
    cls = lookup_method(method)
    LayerRunner.run_layer = _timed(LayerRunner.run_layer, spent, "calibration")  # type: ignore[method-assign]
    cls.convert = _timed(cls.convert, spent, "conversion")  # type: ignore[method-assign]
    args = dict(RECIPES[method], **({"m": m} if method == "nbl" else {}))
    recipe = recipe_from_dict({"name": f"scale-{method}",
                               "calibration": {"source": "wiki", "windows": windows, "seq_len": seq_len, "seed": 0,
                                               "batch_size": 2},
                               "steps": [{"method": method, "layers": "all", "args": args}]})
    sampler = RssSampler()
    start = time.perf_counter()
    report = compress_offloaded(src, recipe, out, dtype=torch.bfloat16, progress=False)
    seconds = time.perf_counter() - start
    rss = sampler.stop()
    chosen = sorted(int(k) for k in report.steps[0]["plan"]["layers"])
    return {"seconds": round(seconds, 1), "calibration_s": round(spent["calibration"], 1),
            "conversion_s": round(spent["conversion"], 1), "converted_layers": chosen,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), **rss,
            "output_bytes": sum(f.stat().st_size for f in out.iterdir()),
            "params_before": report.params_before, "params_after": report.params_after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,4", help="decoder layers of the checkpoints (the full 8B has 32)")
    ap.add_argument("--methods", default="latentllm,nbl")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/attnslim-scale"))
    ap.add_argument("--child", nargs=5, metavar=("SRC", "OUT", "METHOD", "M", "-"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        src, out, method, m, _ = a.child
        run = (plan_child(Path(src), a.windows, a.seq_len) if method == "plan"
               else child(Path(src), Path(out), method, a.windows, a.seq_len, int(m)))
        print(json.dumps(run))
        return
    free = shutil.disk_usage(a.work.parent if not a.work.exists() else a.work).free
    path = RESULTS / "scale.json"
    done = [(m, int(d)) for d in a.depths.split(",") for m in a.methods.split(",")]
    runs = [r for r in (json.loads(path.read_text())["runs"] if path.exists() else [])
            if (r["method"], r["layers"]) not in done]  # runs of other methods and depths are kept
    for depth in (int(x) for x in a.depths.split(",")):
        src = a.work / f"llama3-8b-shapes-{depth}L"
        if not src.exists():
            start = time.perf_counter()
            write_checkpoint(src, depth)
            print(f"wrote {src} in {time.perf_counter() - start:.0f} s", flush=True)
        size = sum(f.stat().st_size for f in src.iterdir())
        for method in a.methods.split(","):
            out = a.work / f"out-{method}-{depth}L"
            shutil.rmtree(out, ignore_errors=True)
            m = max(1, depth // 4)  # nbl: a quarter of the layers (8 of 32 on the full model)
            cmd = [sys.executable, __file__, "--windows", str(a.windows), "--seq-len", str(a.seq_len),
                   "--child", str(src), str(out), method, str(m), "-"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{method} at {depth} layers failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            per_layer = {"calibration_s_per_layer": round(result["calibration_s"] / depth, 2),
                         "conversion_s_per_converted_layer":
                             round(result["conversion_s"] / max(1, len(result["converted_layers"])), 2)}
            runs.append({"method": method, "layers": depth, "checkpoint_bytes": size, **result, **per_layer,
                         "threads": environment()["threads"]})
            print(json.dumps(runs[-1]), flush=True)
            shutil.rmtree(out, ignore_errors=True)
            runs.sort(key=lambda r: (r["method"], r["layers"]))
            path.write_text(json.dumps({  # after every run: a cut-short sweep keeps its runs
                "note": "RANDOM WEIGHTS: these runs measure memory and time only and say nothing about quality.",
                "environment": environment(), "shapes": SHAPES, "full_model_layers": 32, "dtype": "bfloat16",
                "calibration": {"source": "wiki", "windows": a.windows, "seq_len": a.seq_len},
                "disk_free_bytes_before": free, "runs": runs, "extrapolation_70b": extrapolate(runs),
            }, indent=1))


def extrapolate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """70B shapes from the deepest run per method: per-layer time scales with the layer's weights (×4 for
    hidden 8192 / FFN 28672 against 4096 / 14336), memory with one layer plus the embeddings (×2 per dimension)."""
    out = {}
    for method in sorted({r["method"] for r in runs} - {"plan"}):  # a plan converts candidates, not layers
        r = max((r for r in runs if r["method"] == method), key=lambda r: r["layers"])
        scale = 4.0
        seconds = SHAPES_70B["layers"] * (r["calibration_s_per_layer"] * scale) + \
            SHAPES_70B["layers"] * (r["conversion_s_per_converted_layer"] * scale * 8)
        out[method] = {"basis_layers": r["layers"], "hours_if_every_layer_converted": round(seconds / 3600, 1),
                       "peak_rss_mb_estimate": round(r["peak_rss_mb"] * 2, 0),
                       **({"peak_anon_rss_mb_estimate": round(r["peak_anon_rss_mb"] * 2, 0)}
                          if "peak_anon_rss_mb" in r else {}),
                       "assumptions": "per-layer calibration time x4 (weights x4); conversion x8 (SVDs and solves "
                                      "cost grows ~cubically with hidden 4096 -> 8192); RSS x2 (embeddings and "
                                      "one layer's working set)"}
    return out


if __name__ == "__main__":
    main()
