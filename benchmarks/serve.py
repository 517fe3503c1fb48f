"""vLLM serving of dense SmolLM2, its NBL-6, NBL-12 and drop-6 outputs, the DeepSeek-V3 export of its MLA
conversion and the planner's vLLM models at KV 0.5 and 0.25 (`attnslim compress --kv F --engine vllm
--calib-source wiki`): offline throughput, KV capacity, and latency through `attnslim serve` (serve_latency.py).

    .venv/bin/python benchmarks/serve.py [--rounds 2] [--dtype bfloat16]     (needs `make serve-setup`)
    .venv/bin/python benchmarks/serve.py --model qwen2.5-1.5b --prompts 8 --input-len 256 --output-len 64
        # the 1.5B model (`make qwen15`) dense and NBL-12 through attnslim's plugin (vLLM's Llama with qkv_bias),
        # a smaller workload: on 2 CPU cores the default one takes tens of minutes per variant and round

Each round serves every variant once, in turn, in one vLLM process (benchmarks' order alternates between rounds:
interleaved, so drift of a shared machine's load hits every variant alike). Per variant and round: 32 random-token
prompts of 512 tokens, 128 greedy new tokens each (ignore_eos), timed after a warm-up request. KV capacity is
vLLM's own count (allocated blocks × block size) in a fixed VLLM_CPU_KVCACHE_SPACE. The variants' calibration is
small (attnslim.serving.variants): speed and capacity do not depend on the fit. Writes
benchmarks/results/serve.json; `benchmarks/make_report.py` renders it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import RESULTS, environment
from report_serve import results_name
from serve_latency import SPEC as LATENCY_SPEC
from serve_latency import latency

from attnslim.serving.launch import serving_python
from attnslim.serving.variants import KNOWN, MODEL, PLANNED, PLANNED_CALIBRATION, SEQ_LEN, WINDOWS, build

VARIANTS = ("dense", "nbl-6", "nbl-12", "drop-6", "mla-deepseek", "plan-vllm-kv0.5", "plan-vllm-kv0.25")
OTHER_VARIANTS = ("dense", "nbl-12")  # another --model's default: the serving issue's 1.5B rows
KV_GIB = "2"
SPEC = {"prompts": 32, "input_len": 512, "output_len": 128}


def _serving_versions() -> dict[str, str]:
    code = ("import json, platform, torch, transformers, vllm; print(json.dumps({'vllm': vllm.__version__, "
            "'torch': torch.__version__, 'transformers': transformers.__version__, "
            "'python': platform.python_version()}))")
    out = subprocess.run([str(serving_python()), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _round(models: list[str], dtype: str, work: Path, index: int, spec: dict[str, int]) -> dict[str, Any]:
    request = {"models": models, "dtype": dtype, "max_model_len": 1024, "throughput": spec}
    req, out = work / f"request{index}.json", work / f"out{index}.json"
    req.write_text(json.dumps(request))
    log = work / f"round{index}.log"
    with log.open("w") as sink:
        proc = subprocess.run([str(serving_python()), "-m", "attnslim.serving.offline", str(req), str(out)],
                              cwd=work, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KV_GIB), stdout=sink,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"round {index} failed; its log:\n{log.read_text()[-5000:]}")
    return dict(json.loads(out.read_text()))


def latency_only(dtype: str, model: str) -> None:
    path = RESULTS / f"{results_name(model)}.json"
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="attnslim-serve-bench-") as tmp:
        work = Path(tmp)
        for name in data["variants"]:
            directory = str(build(name, work / name, model))
            data["variants"][name]["latency"] = latency(directory, dtype, KV_GIB, work / f"server-{name}.log")
            print(name, {k: round(v, 1) for k, v in data["variants"][name]["latency"].items() if "median" in k},
                  flush=True)
    data["latency_workload"] = LATENCY_SPEC
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-latency", action="store_true", help="skip the OpenAI-server latency phase")
    parser.add_argument("--latency-only", action="store_true", help="rerun only the latency phase into the results")
    parser.add_argument("--model", default=MODEL, help="a packaged model (results: serve.json for the default, "
                        "serve-MODEL.json for another)")
    parser.add_argument("--variants", default="", help="comma-separated (default: every SmolLM2 variant, or dense "
                        f"and nbl-12 for another model); known: {', '.join(KNOWN)}")
    parser.add_argument("--prompts", type=int, default=SPEC["prompts"])
    parser.add_argument("--input-len", type=int, default=SPEC["input_len"])
    parser.add_argument("--output-len", type=int, default=SPEC["output_len"])
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v] or list(VARIANTS if args.model == MODEL else OTHER_VARIANTS)
    if unknown := sorted(set(names) - set(KNOWN)):  # before any model loads
        parser.error(f"unknown variants {unknown}; known: {', '.join(KNOWN)}")
    if args.latency_only:
        return latency_only(args.dtype, args.model)
    spec = {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="attnslim-serve-bench-") as tmp:
        work = Path(tmp)
        dirs = {name: str(build(name, work / name, args.model)) for name in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else list(reversed(names))
            results = _round([dirs[name] for name in order], args.dtype, work, r, spec)
            for name in order:
                runs[name].append(results[dirs[name]])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {results[dirs[n]]['throughput']['output_tokens_per_s']:.1f} tok/s" for n in order), flush=True)
        lat = {} if args.no_latency else {
            name: latency(dirs[name], args.dtype, KV_GIB, work / f"server-{name}.log") for name in names}
    dense_tp = statistics.median(run["throughput"]["output_tokens_per_s"] for run in runs["dense"])
    dense_kv = runs["dense"][0]["kv_tokens"]
    variants = {}
    for name in names:
        per_round = [run["throughput"]["output_tokens_per_s"] for run in runs[name]]
        total = [run["throughput"]["total_tokens_per_s"] for run in runs[name]]
        kv = {run["kv_tokens"] for run in runs[name]}
        if len(kv) != 1:
            sys.exit(f"{name}: vLLM reported different KV capacities across rounds ({sorted(kv)})")
        variants[name] = {
            "output_tokens_per_s": per_round, "total_tokens_per_s": total,
            "median_output_tokens_per_s": statistics.median(per_round),
            "throughput_vs_dense": statistics.median(per_round) / dense_tp,
            "kv_tokens": kv.pop(), "kv_blocks": runs[name][0]["kv_blocks"], "block_size": runs[name][0]["block_size"],
            "start_s": [run["start_s"] for run in runs[name]],
        }
        variants[name]["kv_vs_dense"] = variants[name]["kv_tokens"] / dense_kv
        if name in lat:
            variants[name]["latency"] = lat[name]
    result = {
        "environment": {**environment(), "serving": _serving_versions(), "cpu_count": os.cpu_count()},
        "model": args.model, "dtype": args.dtype, "rounds": args.rounds, "workload": spec,
        "latency_workload": None if args.no_latency else LATENCY_SPEC,
        "kv_cache_space_gib": float(KV_GIB), "calibration": {"source": "wiki", "windows": WINDOWS, "seq_len": SEQ_LEN},
        "variants": variants,
    }
    if any(name in PLANNED for name in variants):
        result["planned_calibration"] = asdict(PLANNED_CALIBRATION)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{results_name(args.model)}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
