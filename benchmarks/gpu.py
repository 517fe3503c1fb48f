"""attnslim on a CUDA GPU: which packaged recipes compress a model that lives on the GPU, and, for MLA, whether
the converted model's cached decode (absorbed: cached latents never decompressed) gives the logits of its full
forward (decompressed) there, and how fast it decodes against dense.

Random weights, real configs. The GPU machines lent to this project reach nothing outside, and a lease carries at
most 64 MiB, so the packaged models' weights cannot travel; their config.json and tokenizer files can. Nothing this
script measures depends on the weights' values: whether each recipe runs, the algebra of the cached path against
the full forward (checked for dense too, so the MLA figure is read against the dense model's own cached-vs-full
difference on the same kernels), dtypes and devices, and speed. Perplexity is measured on CPU with the real weights
(benchmarks/mla.py).

    .venv/bin/python benchmarks/gpu.py --pack DIR                          # here: configs, tokenizers, a text
    python3 benchmarks/gpu.py --from DIR --out FILE --convert-on cpu       # on the GPU machine (PYTHONPATH=src)

How the H200 run in BENCHMARKS was made (this workplace's device tool; the GPU image had transformers 5.17, so the
pinned 5.23 travelled as a 4.5 MB archive of the venv's pure-Python package): here, `echo /.device/ >>
.git/info/exclude`, `--pack .device/pack`, and `tar --exclude=__pycache__ -cJf .device/tf.tar.xz -C
.venv/lib/python3.11/site-packages transformers transformers-5.23.0.dist-info`; there, with `.device` carried,
`mkdir -p /tmp/site && tar -xJf .device/tf.tar.xz -C /tmp/site && PYTHONPATH=/tmp/site:src python3
benchmarks/gpu.py --from .device/pack --out $OUT/gpu.json` (a probe of all 17 recipes needs more than 150 s).

Probe: every packaged recipe on the SmolLM2-135M-shaped model on the GPU (float32), calibration 4 windows x 128
tokens of the pack's text, every training, recovery and heal cut to 2 steps: the result is "ok" or the error and
the attnslim frame it came from. MLA: one-shot `mla` at KV 0.5 (benchmarks/mla.py's mla-kv50), 16 windows x 512,
converted where --convert-on says, then on the GPU. Decode: greedy, HF DynamicCache, interleaved with dense,
medians (attnslim.bench.speed), bfloat16 (checks in float32 and bfloat16), batch 1 and 16.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from attnslim import _compat
from attnslim.api import compress, library_versions
from attnslim.bench import interleaved, kv_bytes_per_token
from attnslim.data import load_text
from attnslim.models import load_model
from attnslim.models.load import checkpoint_directory, load_random
from attnslim.recipe import RECIPES_DIR, recipe_from_dict

MODELS = ("smollm2-135m", "gemma3-270m")
SHAPES_ONLY = ("qwen2.5-1.5b",)  # packed for the planner probe's shapes (`make qwen15` installs it here)
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
CALIBRATION_TEXT = "calibration.txt"


def pack(directory: Path) -> None:
    """Write what the GPU machine needs and cannot download: each packaged model's config and tokenizer files
    and a calibration text."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in MODELS + SHAPES_ONLY:
        load_model(name)  # converts the packaged GGUF into the cache directory if needed
        source = checkpoint_directory(name)
        (directory / name).mkdir(exist_ok=True)
        for file in TOKENIZER_FILES:
            shutil.copy(source / file, directory / name / file)
    (directory / CALIBRATION_TEXT).write_text(load_text("wiki", "calib")[:200_000], encoding="utf-8")


def converted(model: Any, tokenizer: Any, text: Path, device: torch.device) -> Any:
    """`model` (on any device) with one-shot mla at KV 0.5, converted on `device` (the model moves there)."""
    recipe = {"name": "mla-kv50", "steps": [{"method": "mla", "layers": "all", "args": {"kv_ratio": 0.5}}],
              "calibration": {"source": f"file:{text}", "windows": 16, "seq_len": 512, "seed": 0, "batch_size": 4}}
    model.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compress(model, tokenizer, recipe_from_dict(recipe), progress=False)
    return model


def _short(value: Any) -> Any:
    """A recipe's every training / recovery / heal length cut to 2 steps (the probe asks whether it runs)."""
    if isinstance(value, dict):
        return {k: 2 if k == "steps" and isinstance(v, int) else _short(v) for k, v in value.items()}
    return [_short(v) for v in value] if isinstance(value, list) else value


def probe(pack_dir: Path, name: str, device: torch.device, only: set[str], out: dict[str, str],
          save: Callable[[], None]) -> None:
    """Each packaged recipe (or those in `only`) on a fresh random model on `device`: "ok", or the error and
    where it was raised, into `out`, saved after each (a run cut short keeps what it found)."""
    for path in sorted(p for p in RECIPES_DIR.glob("*.yaml") if not only or p.stem in only):
        raw = _short(yaml.safe_load(path.read_text()))
        raw["calibration"] = {"source": f"file:{pack_dir / CALIBRATION_TEXT}", "windows": 4, "seq_len": 128,
                              "seed": 0, "batch_size": 4}
        if "heal" in raw:
            raw["heal"] |= {"source": f"file:{pack_dir / CALIBRATION_TEXT}", "seq_len": 128}
        model, tokenizer = load_random(pack_dir / name)
        model.to(device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compress(model, tokenizer, recipe_from_dict(raw), progress=False)
            after = {p.device.type for p in model.parameters()}
            out[path.stem] = "ok" if after == {device.type} else f"ran, but parameters now on {sorted(after)}"
        except Exception as err:  # the probe reports every failure and goes on to the next recipe
            frames = [f for f in traceback.extract_tb(err.__traceback__) if "/attnslim/" in f.filename]
            at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
            out[path.stem] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:240]}{at}"
        print(f"probe {path.stem}: {out[path.stem]}", flush=True)
        save()


def plan_probe(pack_dir: Path, name: str, device: torch.device, kv: float, out: dict[str, Any]) -> None:
    """The planner on `device`: `attnslim plan` at `kv` (short settings: 4 calibration windows of 512 tokens, 2
    scoring windows, one refinement round, three MLA widths) and the compression of its plan, both on a random
    model living there; then the mixed model's checks (cached decode against the full forward, greedy generation)
    and the timings. Random weights make the choices meaningless; what this measures is that the path runs on the
    device, its numerics, and how long it takes there."""
    from attnslim.planner.run import PlanConfig, plan_model
    from attnslim.recipe import Calibration

    model, tokenizer = load_random(pack_dir / name)
    model.to(device)
    cal = Calibration(source=f"file:{pack_dir / CALIBRATION_TEXT}", windows=4, seq_len=512, seed=0, batch_size=4)
    cfg = PlanConfig(kv=kv, calibration=cal, score_windows=2, refine_windows=2, rounds=1, tries=2,
                     ladder=(0.25, 0.5, 0.75), mla_args={})  # refit_o needs more calibration than this probe draws
    began = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan_model(model, tokenizer, cfg, progress=False)
        planned = time.time()
        compress(model, tokenizer, result.recipe, progress=False, methods=result.methods)
    vocab = int(model.config.vocab_size)
    out.update({"kv": kv, "plan_seconds": round(planned - began, 1),
                "compress_seconds": round(time.time() - planned, 1),
                "choices": [row["choice"] for row in result.report["layers"]], "used": result.report["used"],
                "devices": sorted({p.device.type for p in model.parameters()}),
                "cached_vs_full": cached_vs_full(model, vocab), "greedy_cached_equals_uncached":
                generate_matches_greedy(model, vocab)})
    print(f"plan {name} kv {kv}: {out}", flush=True)


@torch.no_grad()
def cached_vs_full(model: Any, vocab: int, prefix: int = 64, steps: int = 32) -> float:
    """max |cached − full| / max |full| over the logits of `steps` tokens decoded one at a time after a `prefix`
    prefill, against one forward over the whole sequence without a cache (batch 2)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (2, prefix + steps), generator=torch.Generator().manual_seed(1)).to(device)
    full = model(input_ids=ids, use_cache=False).logits.float()  # (2, T, vocab)
    cache = _compat.new_cache(model.config, "dynamic", prefix + steps)
    rows = [model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True).logits[:, -1:].float()]
    for t in range(prefix, prefix + steps - 1):
        rows.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits.float())
    stepped = torch.cat(rows, dim=1)  # (2, steps, vocab): positions prefix-1 .. T-2
    reference = full[:, prefix - 1 : prefix + steps - 1]
    return float((stepped - reference).abs().max() / reference.abs().max())


@torch.no_grad()
def generate_matches_greedy(model: Any, vocab: int, new: int = 16) -> bool:
    """generate() (cached, greedy) gives the tokens of a greedy loop of full forwards without a cache."""
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(2)).to(device)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    seq = ids
    for _ in range(new):
        seq = torch.cat([seq, model(input_ids=seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return bool(torch.equal(out, seq))


def run_model(name: str, pack_dir: Path, contexts: list[int], batches: list[int], repeats: int,
              device: torch.device, convert_on: torch.device, out: dict[str, Any], save: Callable[[], None]) -> None:
    """Checks and speed of dense and mla-kv50 into `out`, saved after each measurement (a cut run keeps them)."""
    dense, tokenizer = load_random(pack_dir / name)
    vocab = int(dense.config.vocab_size)
    mla, _ = load_random(pack_dir / name)  # the same seed: the same random weights as dense
    began = time.time()
    converted(mla, tokenizer, pack_dir / CALIBRATION_TEXT, convert_on)
    dense, mla = dense.to(device), mla.to(device)
    out |= {"convert_s": time.time() - began, "converted_on": str(convert_on), "checks": {}, "speed": {},
            "kv_bytes_per_token": {}}
    for dtype in (torch.float32, torch.bfloat16):
        models = {"dense": dense.to(dtype), "mla-kv50": mla.to(dtype)}
        label = str(dtype).removeprefix("torch.")
        out["checks"][label] = {k: {"cached_vs_full": cached_vs_full(m, vocab)} for k, m in models.items()}
        if dtype == torch.float32:  # bfloat16 ties flip argmax between kernels; the logit check covers it there
            for k, m in models.items():
                out["checks"][label][k]["generate_equals_greedy"] = generate_matches_greedy(m, vocab)
        out["kv_bytes_per_token"][label] = {k: kv_bytes_per_token(m)["total"] for k, m in models.items()}
        save()
        for batch in batches if dtype == torch.bfloat16 else []:  # speed in the dtype GPU users serve in
            def prompt(n: int, b: int = batch) -> torch.Tensor:
                return torch.randint(0, min(vocab, 1000), (b, n), generator=torch.Generator().manual_seed(n))
            result = interleaved(models, contexts, new_tokens=64, repeats=repeats, prompt=prompt, progress=False)
            out["speed"][f"{label}-batch{batch}"] = result
            save()
            print(name, label, f"batch {batch}:", {c: round(result["models"]["mla-kv50"][str(c)]["decode_ratio"], 2)
                                                   for c in contexts}, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pack", type=Path, help="write the configs, tokenizers and text into this directory")
    parser.add_argument("--from", dest="source", type=Path, help="a directory written by --pack (on the GPU)")
    parser.add_argument("--out", type=Path, help="results JSON (on the GPU)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cpu: a quick trial of the script before a GPU lease")
    parser.add_argument("--convert-on", default="cuda", help="where the MLA conversion runs (cpu or cuda)")
    parser.add_argument("--probe", default="smollm2-135m", help="the model the recipe probe runs on ('' for none)")
    parser.add_argument("--recipes", default="", help="comma-separated recipe names the probe runs (default: all)")
    parser.add_argument("--plan", default="", help="models the planner probe runs on, comma-separated ('' none)")
    parser.add_argument("--plan-kv", type=float, default=0.5)
    args = parser.parse_args()
    if args.pack:
        pack(args.pack)
        return
    if not (args.source and args.out) or (args.device == "cuda" and not torch.cuda.is_available()):
        sys.exit("give --pack DIR here, or --from DIR --out FILE on a machine with a CUDA GPU (or --device cpu)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
    env = {**library_versions(), "gpu": gpu, "command": shlex.join(["benchmarks/gpu.py", *sys.argv[1:]])}
    results: dict[str, Any] = {"environment": env, "models": {}}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1))

    for name in [n for n in args.models.split(",") if n]:
        results["models"][name] = {}
        run_model(name, args.source, [int(c) for c in args.contexts.split(",")],
                  [int(b) for b in args.batches.split(",")], args.repeats, torch.device(args.device),
                  torch.device(args.convert_on), results["models"][name], save)
    if args.probe:
        results["probe"] = {"model": args.probe, "recipes": {}}
        probe(args.source, args.probe, torch.device(args.device), {r for r in args.recipes.split(",") if r},
              results["probe"]["recipes"], save)
    for name in [n for n in args.plan.split(",") if n]:
        results.setdefault("plan", {})[name] = {}
        try:
            plan_probe(args.source, name, torch.device(args.device), args.plan_kv, results["plan"][name])
        except Exception as err:  # reported, and the next model still runs
            results["plan"][name]["error"] = f"{type(err).__name__}: {err}"[:400]
            traceback.print_exc()
        save()
    print(json.dumps({n: r.get("checks") for n, r in results["models"].items()}, indent=1))


if __name__ == "__main__":
    main()
