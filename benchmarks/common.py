"""Shared benchmark harness: the same evaluation windows for every variant, results saved incrementally.

Each variant = one recipe applied to a fresh copy of the model; results are appended to a JSON file under
benchmarks/results/ as soon as they exist, so an interrupted run resumes where it stopped (variants whose
recipe is already recorded are skipped: same recipe fingerprint, and the same method defaults where the row
recorded them, `resolved_fingerprint`).

Device: `ATTNSLIM_BENCH_DEVICE=cuda` runs every variant's compression and evaluation on a GPU (the model is
loaded on CPU, then moved there; every result records its device). Default: the CPU.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from attnslim import host
from attnslim.adapters import get_adapter
from attnslim.api import compress, library_versions
from attnslim.bench import kv_bytes_per_token
from attnslim.data import TokenWindows, eval_windows
from attnslim.eval import perplexity
from attnslim.methods import lookup_method
from attnslim.models import load_model
from attnslim.recipe import Recipe, digest, fingerprint, recipe_from_dict, recipe_to_dict
from attnslim.settings import HealConfig

RESULTS = Path(__file__).parent / "results"
DEVICE = torch.device(os.environ.get("ATTNSLIM_BENCH_DEVICE", "cpu"))


def load_on_device(name: str) -> tuple[Any, Any]:
    """`load_model(name)` moved to the benchmark's DEVICE."""
    model, tokenizer = load_model(name)
    return model.to(DEVICE), tokenizer


def resolved_fingerprint(recipe: Recipe) -> str:
    """`digest` of the recipe with every method argument and heal setting it leaves out written
    in at today's default. A stored row whose run used a default that has changed since is measured again: the
    recipe's own fingerprint cannot see that. Defaults a method derives while compressing (a rule of the model's
    shapes, e.g. mla's rope_dims=None) stay invisible to both."""
    d = recipe_to_dict(recipe)
    for step, out in zip(recipe.steps, d["steps"], strict=True):
        out["args"] = lookup_method(step.method).from_args(dict(step.args)).args()
    if recipe.heal is not None:
        heal = asdict(HealConfig.from_dict(recipe.heal))
        for key in ("teacher_dtype", "checkpoint"):  # memory settings added later; at their defaults they are what
            if heal[key] == getattr(HealConfig, key):  # every stored row ran, so those rows stay current
                del heal[key]
        d["heal"] = heal
    return digest(d)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows: speed results from different
    machines differ (a shared runner's host can change between runs), so every result names its CPU."""
    return host.cpu_info("model name") or platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Versions, CPU and threads, and the BLAS torch calls with the CPU's vendor: torch's x86 wheels use MKL,
    which runs its generic code on non-Intel CPUs (BENCHMARKS "MLA: decode core kernels"), so the vendor
    changes what is fast. A preloaded library (LD_PRELOAD) is recorded too: it can change that dispatch."""
    env = {
        **library_versions(), "python": platform.python_version(), "device": DEVICE.type,
        **({"gpu": torch.cuda.get_device_name(DEVICE)} if DEVICE.type == "cuda" else {}),
        "cpu": cpu_model(), "cpu_vendor": host.cpu_info("vendor_id"), "blas": host.blas_name(),
        "threads": torch.get_num_threads(),
        "command": shlex.join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),  # quoted: re-runnable
    }
    if os.environ.get("LD_PRELOAD"):
        env["ld_preload"] = os.environ["LD_PRELOAD"]
    return env


class Harness:
    def __init__(self, name: str, model: str = "smollm2-135m", sources: tuple[str, ...] = ("wiki", "ptb", "c4"),
                 tokens: int = 8192, seq_len: int = 512) -> None:
        self.path = RESULTS / f"{name}.json"
        self.model_name, self.sources, self.tokens, self.seq_len = model, sources, tokens, seq_len
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data.setdefault("variants", {})
        evaluation: dict[str, Any] = {"sources": list(sources), "tokens": tokens, "seq_len": seq_len}
        previous = self.data.get("eval", {})
        if "descriptions" in previous and all(previous.get(k) == v for k, v in evaluation.items()):
            evaluation["descriptions"] = previous["descriptions"]  # a run that reuses the stored dense rows
        self.stored_environment: dict[str, Any] = self.data.get("environment", {})  # the file's last writer
        self.data.update({"model": model, "eval": evaluation, "environment": environment()})
        self._windows: dict[str, Any] = {}

    def windows(self, tokenizer: Any) -> dict[str, Any]:
        """The evaluation windows; refuses a results file whose stored rows were scored on other windows (e.g.
        before windows started with the tokenizer's BOS), so that no ratio mixes the two."""
        if not self._windows:
            self._windows = {s: eval_windows(s, tokenizer, self.tokens, self.seq_len) for s in self.sources}
            new = {s: w.description for s, w in self._windows.items()}
            old = self.data["eval"].get("descriptions")
            if old and old != new and ("dense" in self.data or self.data["variants"]):
                raise SystemExit(f"{self.path} holds rows scored on other windows ({old}; now {new}): run under a "
                                 "new --name, or move the file away")
            self.data["eval"]["descriptions"] = new
        return self._windows

    def evaluate(self, model: Any, tokenizer: Any, label: str) -> dict[str, Any]:
        ppl = {s: perplexity(model, w, label=f"{label}:{s}").ppl for s, w in self.windows(tokenizer).items()}
        return {"ppl": ppl, "params": get_adapter(model).param_groups(),
                "kv_bytes_per_token": kv_bytes_per_token(model)["total"]}

    def dense(self) -> dict[str, Any]:
        if "dense" not in self.data:
            model, tokenizer = load_on_device(self.model_name)
            self.data["dense"] = self.evaluate(model, tokenizer, "dense")
            self.save()
        return dict(self.data["dense"])

    def run(self, key: str, recipe: Recipe | dict[str, Any], extra: dict[str, Any] | None = None,
            windows: TokenWindows | None = None) -> dict[str, Any]:
        """Compress a fresh copy of the model by `recipe`, score it, record row `key` (skipped where the file holds it
        for the same recipe). `windows`: calibration windows drawn already under the recipe's calibration (a plan's,
        attnslim.compress(windows=)): text the model samples itself is not sampled again."""
        recipe = recipe if isinstance(recipe, Recipe) else recipe_from_dict(recipe)
        done = self.data["variants"].get(key)
        resolved = resolved_fingerprint(recipe)  # rows stored before it was recorded are judged by the recipe's
        if (done and done.get("recipe_fingerprint") == fingerprint(recipe)
                and done.get("resolved_fingerprint", resolved) == resolved):
            print(f"[skip] {key}: already measured", flush=True)
            return dict(done)
        dense = self.dense()
        model, tokenizer = load_on_device(self.model_name)
        self.windows(tokenizer)  # before compressing: refuses stored rows scored on other windows
        start = time.time()
        report = compress(model, tokenizer, recipe, windows=windows)
        result = self.evaluate(model, tokenizer, key)
        result.update({
            "recipe": report.recipe, "recipe_fingerprint": report.recipe_fingerprint,
            "resolved_fingerprint": resolved,
            "plans": [{"method": s["method"], "plan": s["plan"]} for s in report.steps],
            "calibration": report.calibration, "compress_seconds": round(report.seconds, 1),
            "peak_rss_mb": round(report.peak_rss_mb), "wall_seconds": round(time.time() - start, 1),
            "command": environment()["command"], "threads": torch.get_num_threads(),
            **({"heal": report.heal} if report.heal else {}), **({"head": report.head} if report.head else {}),
            **(extra or {}),
        })
        return self.record(key, result, dense)

    def record(self, key: str, result: dict[str, Any], dense: dict[str, Any], note: str = "") -> dict[str, Any]:
        """Add ratios to the dense model and kept fractions to an evaluated variant, save it, print a line."""
        result["ppl_ratio"] = {s: result["ppl"][s] / dense["ppl"][s] for s in self.sources}
        result["kept"] = {g: result["params"][g] / dense["params"][g] for g in ("attention", "mlp", "total")}
        self.data["variants"][key] = result
        self.save()
        ratios = ", ".join(f"{s} {v:.3f}x" for s, v in result["ppl_ratio"].items())
        note = note or f"kept attention {result['kept']['attention']:.3f}"
        print(f"[done] {key}: {ratios}; {note}", flush=True)
        return result

    def save(self) -> None:
        """Write the results file, keeping the rows another process recorded in it since this one read it: two
        benchmarks writing one file (e.g. two budgets of plan.py) would otherwise each replace the other's rows
        with their own copy. A lock on the results folder orders the writers; a row this process measured wins."""
        RESULTS.mkdir(parents=True, exist_ok=True)
        folder = os.open(RESULTS, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            if self.path.exists():
                for key, row in json.loads(self.path.read_text()).get("variants", {}).items():
                    self.data["variants"].setdefault(key, row)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=float))
            tmp.replace(self.path)
        finally:
            os.close(folder)  # releases the lock


def selected(only: str, known: Iterable[str], groups: str | None = None) -> set[str]:
    """The variant keys of a comma-separated `--only` (spaces ignored; empty: every known key). A key the run does not
    define (`groups`: the script's --groups, where it has them) stops the run before any work: skipped silently, a
    requested row would just be missing."""
    keys, known = {k.strip() for k in only.split(",") if k.strip()}, list(known)
    unknown = sorted(keys - set(known))
    if unknown:
        scope = f"--groups {groups}" if groups else "this run"
        fix = ("add the group that defines them (the script's docstring lists each group's variants)" if groups
               else f"it defines {', '.join(known[:12])}{', ...' if len(known) > 12 else ''}")
        raise SystemExit(f"--only names variants that {scope} does not define: {', '.join(unknown)}; {fix}")
    return keys or set(known)


def calibration(windows: int = 32, seq_len: int = 512, source: str = "wiki") -> dict[str, Any]:
    return {"source": source, "windows": windows, "seq_len": seq_len, "seed": 0, "batch_size": 4}
