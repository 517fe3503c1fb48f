"""Offloaded against in-memory compression on SmolLM2-135M: wall time (interleaved runs, medians) and bit identity.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/offload_time.py --repeats 3
writes benchmarks/results/offload_time.json (target of issue 22: offloaded <= 1.3x in-memory). Both paths run the
same recipe in this process, in turn (in-memory, offloaded, in-memory, ...), so load on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment  # noqa: E402

from attnslim.api import compress_to  # noqa: E402
from attnslim.recipe import recipe_from_dict  # noqa: E402


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--method", default="svdllm")
    ap.add_argument("--args", default='{"ratio": 0.5}')
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args()
    recipe = recipe_from_dict({"name": f"offload-time-{a.method}",
                               "calibration": {"source": "wiki", "windows": a.windows, "seq_len": a.seq_len,
                                               "seed": 0},
                               "steps": [{"method": a.method, "layers": "all", "args": json.loads(a.args)}]})
    times: dict[str, list[float]] = {"in_memory": [], "offloaded": []}
    identical = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for mode in ("in_memory", "offloaded"):
                out = Path(tmp) / f"{mode}-{r}"
                start = time.perf_counter()
                compress_to("smollm2-135m", recipe, out, offload=mode == "offloaded", progress=False)
                times[mode].append(round(time.perf_counter() - start, 2))
            mem, off = weights(Path(tmp) / f"in_memory-{r}"), weights(Path(tmp) / f"offloaded-{r}")
            identical.append(mem.keys() == off.keys() and all(
                mem[k].dtype == off[k].dtype and torch.equal(mem[k], off[k]) for k in mem))
            for mode in times:
                shutil.rmtree(Path(tmp) / f"{mode}-{r}")
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    result = {"environment": environment(), "model": "smollm2-135m", "recipe": recipe.name, "method": a.method,
              "args": json.loads(a.args), "calibration": {"source": "wiki", "windows": a.windows,
                                                          "seq_len": a.seq_len},
              "seconds": times, "median_seconds": medians,
              "ratio_offloaded_to_in_memory": round(medians["offloaded"] / medians["in_memory"], 3),
              "bit_identical": all(identical)}
    (RESULTS / "offload_time.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_seconds", "ratio_offloaded_to_in_memory", "bit_identical")}))


if __name__ == "__main__":
    main()
