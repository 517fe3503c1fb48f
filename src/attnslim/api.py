"""`compress(model, tokenizer, recipe)`: the one orchestrator. Mutates the model in place."""

from __future__ import annotations

import copy
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnslim import _compat
from attnslim.adapters import get_adapter
from attnslim.adapters.base import Adapter
from attnslim.api_checks import check_device, check_drawn, check_model, check_tokenizer, refuse_compressed
from attnslim.bench import kv_bytes_per_token
from attnslim.calib.residency import InMemoryLayers, Residency
from attnslim.compress_memory import lean_heal, model_bytes, offload_reason
from attnslim.data import TokenWindows, calib_windows, check_draw
from attnslim.data.generated import SELF
from attnslim.data.sources import mixture
from attnslim.errors import AttnslimError, first_line
from attnslim.methods import METHODS, Method, lookup_method
from attnslim.pipeline import run_step
from attnslim.pipeline.head import check_head_section, prepare_head, run_head
from attnslim.recipe import Calibration, Recipe, fingerprint, recipe_to_dict, rest_layers
from attnslim.train.heal import HealConfig, heal, heal_draw

if TYPE_CHECKING:
    from attnslim.models.load import Checkpoint


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class CompressionReport:
    recipe: dict[str, Any]
    recipe_fingerprint: str
    steps: list[dict[str, Any]]  # per step: method, args, layers (candidates), plan
    calibration: dict[str, Any]
    params_before: dict[str, int]
    params_after: dict[str, int]
    kv_bytes_per_token_before: float
    kv_bytes_per_token_after: float
    kv_bytes_per_layer_dense: list[float]
    kv_bytes_per_layer_after: list[float]
    seconds: float
    peak_rss_mb: float
    versions: dict[str, str] = field(default_factory=dict)
    heal: dict[str, Any] | None = None  # train/heal.heal's report when the recipe heals
    no_decode_layers: list[int] = field(default_factory=list)  # non-causal layers: the model cannot generate
    head: dict[str, Any] | None = None  # pipeline/head.run_head's record when the recipe has a head: section

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """The CLI's one-line JSON: sizes before/after, KV bytes, time, memory."""
        ratio = {
            k: self.params_after[k] / self.params_before[k]
            for k in ("attention", "mlp", "total")
            if self.params_before.get(k)
        }
        return {
            "recipe": self.recipe.get("name"), "params_before": self.params_before,
            "params_after": self.params_after, "kept_ratio": ratio,
            "kv_bytes_per_token": {"before": self.kv_bytes_per_token_before, "after": self.kv_bytes_per_token_after},
            "no_decode_layers": self.no_decode_layers,
            "seconds": round(self.seconds, 1), "peak_rss_mb": round(self.peak_rss_mb, 1),
        }


def library_versions() -> dict[str, str]:
    import transformers

    import attnslim

    return {"attnslim": attnslim.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def compress(model: Any, tokenizer: Any, recipe: Recipe, progress: bool = True,
             residency: Residency | None = None, device: torch.device | str | None = None,
             methods: list[Method] | None = None, windows: TokenWindows | None = None) -> CompressionReport:
    """Apply every step of `recipe` to `model` (in place) and report what changed.

    `residency` says where the weights live (calib/residency.py): by default the whole model is in memory and
    every layer's work runs on the model's device; `attnslim.offload.OffloadedLayers` keeps them on disk and
    writes the compressed layers to output shards as it goes (the model then stays a skeleton). `device` (default:
    the model's) is where each layer's calibration and conversion run when the model is in memory. `methods`: the
    steps' methods as `check_recipe(recipe)` returned them, for a caller that checked the recipe before loading
    the model (compress_to), so each is built once; by default they are built here. `windows`: the calibration
    windows drawn already under `recipe.calibration` from this model (a plan's: `PlanResult.windows`), so text the
    model samples itself (`self`) is not sampled twice; drawn here when absent, or when a method asks for more."""
    start = time.time()
    check_model("compress", model)
    check_tokenizer("compress", tokenizer)
    if not isinstance(recipe, Recipe):
        fix = f"attnslim.load_recipe({recipe!r})" if isinstance(recipe, str | Path) else "attnslim.load_recipe(NAME)"
        raise TypeError(f"compress: recipe must be an attnslim.Recipe, got {type(recipe).__name__} {recipe!r}; "
                        f"pass {fix}")
    device = check_device("compress", device)
    adapter = get_adapter(model)
    residency = residency or InMemoryLayers(model, adapter.decoder_layers(),
                                            device or _compat.input_device(model))
    refuse_compressed(model)
    steps = recipe.resolve(adapter.num_layers(), _methods())
    methods = check_recipe(recipe) if methods is None else _matching(recipe, methods)
    if residency.offloaded:
        refuse_offloaded(recipe, methods)
    head = prepare_head(adapter, recipe.head, residency)  # refused before any work (a tied head needs untie)
    before, kv_before = adapter.param_groups(), _kv_bytes(model, residency)
    if windows is not None:
        check_drawn(windows, recipe.calibration)
    asked, recipe = recipe.calibration, replace(recipe, calibration=calibration_for(recipe, methods, adapter))
    cal = recipe.calibration
    if residency.offloaded and SELF in mixture(cal.source):
        raise AttnslimError("calibration.source 'self' samples the dense model, which --offload keeps on disk; "
                            "compress without --offload, or calibrate on a text source (wiki, c4, file:PATH)")
    if windows is None or cal != asked:  # none drawn, or a method raised the count: draw what it needs
        windows = calib_windows(cal.source, tokenizer, cal.windows, cal.seq_len, cal.seed,
                                f"calibration.windows={cal.windows}", model=model)
    heal_config = None if recipe.heal is None else HealConfig.from_dict(recipe.heal)
    if heal_config is not None:  # the heal's data, refused here rather than after every step has run
        check_draw(heal_config.source, tokenizer, heal_config.steps * heal_config.batch_size, heal_config.seq_len,
                   heal_draw(heal_config), ("heal.steps", heal_config.batch_size))
    done: list[dict[str, Any]] = []
    # the teacher of every training step and of the heal: the model before the first step, so a later step
    # distils towards the original and also corrects what earlier steps lost (progressive conversion)
    trains = recipe.heal is not None or any(method.trains for method in methods)
    bf16 = recipe.heal is not None and HealConfig.from_dict(recipe.heal).teacher_dtype == "bfloat16"
    lean = bf16 and not any(method.trains for method in methods)  # a training step keeps a float32 teacher
    original = _frozen_copy(model, torch.bfloat16 if lean else None) if trains else None
    for (step, candidates), method in zip(steps, methods, strict=True):
        converted = {int(k) for d in done for k in d["plan"]["layers"]}
        layers = rest_layers(adapter.num_layers(), converted) if candidates is None else candidates
        with torch.no_grad(), _named_meta_errors(residency, step.method):
            plan = run_step(model, adapter, method, layers, windows.ids, cal.batch_size, progress, residency)
        if method.trains:
            plan.info["training"] = method.train_step(model, tokenizer, original, progress)
        done.append({"method": step.method, "args": method.args(), "candidates": layers, "plan": plan.to_json()})
    head_record = None if head is None else run_head(model, adapter, head, windows.ids, cal.batch_size, residency)
    healed = None
    if heal_config is not None:  # `original` was kept above
        healed = heal(model, original, tokenizer, heal_config, progress)
    del original
    kv_after = _kv_bytes(model, residency)
    return CompressionReport(
        recipe=recipe_to_dict(recipe), recipe_fingerprint=fingerprint(recipe), steps=done,
        calibration={"description": windows.description, "tokens": windows.n_tokens,
                     "fingerprint": windows.fingerprint()},
        params_before=before, params_after=adapter.param_groups(),
        kv_bytes_per_token_before=kv_before["total"], kv_bytes_per_token_after=kv_after["total"],
        kv_bytes_per_layer_dense=kv_before["per_layer"], kv_bytes_per_layer_after=kv_after["per_layer"],
        seconds=time.time() - start, peak_rss_mb=peak_rss_mb(), versions=library_versions(), heal=healed,
        no_decode_layers=kv_after["no_decode"], head=head_record,
    )


def calibration_for(recipe: Recipe, methods: list[Method], adapter: Adapter) -> Calibration:
    """The recipe's calibration, with its window count raised to what its steps need on this model
    (`raised_calibration`)."""
    steps = [(f"recipe {recipe.name!r} step {i} ({method.name})", method) for i, method in enumerate(methods)]
    return raised_calibration(recipe.calibration, steps, adapter)


def raised_calibration(cal: Calibration, steps: Sequence[tuple[str, Method]], adapter: Adapter) -> Calibration:
    """`cal` with its window count raised to the largest need of `steps` (what names each, its method) on this model.

    Decision: a method whose calibration need grows with the model (mla's output refit: 24 tokens per input
    dimension of o_proj) raises the window count itself, with a log line, instead of refusing. A recipe's count is
    tuned on one model (SmolLM2's 576 wide o_proj), and below the need the step could only refuse; raising is what
    every user would do by hand. The raised count is the recipe that compression.json records (and the recipe a
    plan writes), so the run is reproducible from it. Windows keep the recipe's seq_len (its context length)."""
    needs = [(need, what) for what, method in steps if (need := method.calibration_need(adapter))]
    if not needs:
        return cal
    need, what = max(needs, key=lambda item: item[0].tokens)
    windows = -(-need.tokens // cal.seq_len)  # ceil
    if windows <= cal.windows:
        return cal
    print(f"attnslim: calibration raised from {cal.windows} to {windows} windows of {cal.seq_len} tokens: {what} "
          f"needs at least {need.tokens:,} tokens on this model for {need.why}", flush=True)
    return replace(cal, windows=windows)


def compress_offloaded(directory: Path, recipe: Recipe, out: Path, overwrite: bool = False,
                       dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", progress: bool = True,
                       extra: dict[str, Any] | None = None, tokenizer: Any = None) -> CompressionReport:
    """Compress the safetensors checkpoint in `directory` into `out` with one decoder layer in memory at a time.

    Weights are read through safetensors' memory map and written as one shard per decoder layer as each is
    final (attnslim.offload); `out` appears only when everything is written (outdir.staged_output). Gives the
    same weights, bit for bit, as `compress` on the model loaded in memory with the same dtype and device."""
    from attnslim.models.load import read_checkpoint, skeleton

    methods = check_recipe(recipe)
    checkpoint = read_checkpoint(directory)
    return _compress_offloaded(checkpoint, skeleton(checkpoint, dtype), methods, recipe, out, overwrite, device,
                               progress, extra, tokenizer)


def _compress_offloaded(checkpoint: Checkpoint, model: Any, methods: list[Method], recipe: Recipe, out: Path,
                        overwrite: bool, device: torch.device | str, progress: bool, extra: dict[str, Any] | None,
                        tokenizer: Any = None) -> CompressionReport:
    """`compress_offloaded` of a checkpoint already read, its skeleton `model` and the recipe's checked methods."""
    from attnslim.io import save_sharded_metadata
    from attnslim.offload import OffloadedLayers, WeightSource, check_free_disk
    from attnslim.outdir import staged_output

    tokenizer = tokenizer if tokenizer is not None else checkpoint.tokenizer  # the directory's, unless one is given
    source = WeightSource(checkpoint.directory)  # a missing or truncated shard is named here, before any work
    check_free_disk(out, model_bytes(model))
    adapter = get_adapter(model)
    adapter.refuse_offload()
    with staged_output(out, overwrite) as tmp:
        residency = OffloadedLayers(model, adapter.decoder_layers(), source, tmp, device,
                                    skip=(model.get_output_embeddings(),))
        report = compress(model, tokenizer, recipe, progress, residency, methods=methods)
        shards = residency.finish()
        report.peak_rss_mb = peak_rss_mb()
        save_sharded_metadata(model, tokenizer, tmp, {**report.to_json(), **(extra or {})}, shards)
    return report


def compress_to(name_or_path: str, recipe: Recipe, out: Path, overwrite: bool = False, offload: bool = False,
                device: str = "cpu", dtype: str = "float32", progress: bool = True) -> CompressionReport:
    """Load `name_or_path`, compress it and save it to `out` (the `compress` command): in memory, or with the
    weights on disk (`offload`, also chosen, with a message, when the model would not fit in memory). `device` and
    `dtype` are where and in what each layer is computed; statistics are float64 either way.

    Decision: every input is resolved once, and refused before any model is loaded: each step's method is built
    and checked once (and handed to `compress`), a local checkpoint's config.json is read once
    (models/load.read_checkpoint) and its one meta-device skeleton sizes the memory estimate and, with --offload,
    is the model compressed. Before, one command built each method four times and read config.json six times."""
    from attnslim.io import save
    from attnslim.models.load import (
        checkpoint_directory,
        load_model,
        load_weights,
        read_checkpoint,
        skeleton,
    )
    from attnslim.offload import check_free_disk
    from attnslim.offload.compute import compute_target
    from attnslim.outdir import check_output

    methods = check_recipe(recipe)  # refused before seconds of loading and minutes of compressing
    refuse_compressed(name_or_path)
    check_output(out, overwrite, inputs=[Path(name_or_path)])
    compute_device, compute_dtype = compute_target(device, dtype)
    try:
        checkpoint: Checkpoint | None = read_checkpoint(checkpoint_directory(name_or_path))
    except AttnslimError:
        if offload:
            raise
        checkpoint = None  # a hub id, or a directory load_model refuses with its own message: loaded in memory
    shape = None if checkpoint is None else skeleton(checkpoint, compute_dtype)
    if not offload and shape is not None:
        size = model_bytes(shape)
        if lean := lean_heal(size, recipe, methods):
            recipe, why = lean
            print(f"attnslim: {why}", flush=True)
        if reason := offload_reason(size, recipe, methods, compute_dtype):
            print(f"attnslim: {reason}", flush=True)
            offload = True
    extra = {"base_model": name_or_path, "compute": {"device": str(compute_device), "dtype": dtype,
                                                     "offload": offload}}
    if offload and checkpoint is not None and shape is not None:
        return _compress_offloaded(checkpoint, shape, methods, recipe, out, overwrite, compute_device, progress,
                                   extra)
    del shape
    if checkpoint is None:
        model, tokenizer = load_model(name_or_path, compute_dtype)
    else:
        model, tokenizer = load_weights(checkpoint, compute_dtype), checkpoint.tokenizer
    check_free_disk(out, model_bytes(model))  # the output is at most the dense weights: a full disk fails now
    report = compress(model, tokenizer, recipe, progress, device=compute_device, methods=methods)
    save(model, tokenizer, out, {**report.to_json(), **extra}, overwrite=overwrite)
    return report


def _kv_bytes(model: Any, residency: Residency) -> dict[str, Any]:
    """KV bytes measured on the decoder (the cache does not depend on the output head, which offloading never
    loads), one layer at a time when the weights are offloaded."""
    with residency.streamed():
        return kv_bytes_per_token(model.get_decoder())


@contextmanager
def _named_meta_errors(residency: Residency, method: str) -> Iterator[None]:
    """With offloaded weights every layer but the one being worked on is on the meta device: a method that reads
    another layer's weights (or runs a whole-model forward) fails there. Say which method, instead of torch's
    bare "meta tensor" error."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as err:
        if not (residency.offloaded and "meta" in str(err)):
            raise
        raise AttnslimError(f"method {method!r} cannot run with --offload: it reads weights outside the decoder "
                            f"layer being converted ({first_line(err, 160)}); compress in memory") from err


def refuse_offloaded(recipe: Recipe, methods: list[Method]) -> None:
    """What offloaded compression cannot do, refused before any work, naming the step and the method."""
    if recipe.heal is not None:
        raise AttnslimError(f"recipe {recipe.name!r}: heal trains the whole model against a copy of it, which "
                            "--offload cannot hold; remove heal: or compress in memory")
    for i, method in enumerate(methods):
        if method.trains:
            raise AttnslimError(f"recipe {recipe.name!r} step {i} ({method.name}) cannot run with --offload: it "
                                "trains the whole model after converting (a teacher copy and gradients through every "
                                "layer)")


def _frozen_copy(model: Any, dtype: torch.dtype | None = None) -> Any:
    """A frozen copy of `model`; with `dtype`, its parameters are copied straight into that dtype (deepcopy's memo
    maps each parameter to its cast copy), so a bfloat16 teacher never holds a float32 copy on the way."""
    memo: dict[int, Any] = {}
    if dtype is not None:
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
    teacher = copy.deepcopy(model, memo).eval()
    teacher.requires_grad_(False)
    return teacher


def _methods() -> dict[str, type]:
    return dict(METHODS)


def _matching(recipe: Recipe, methods: list[Method]) -> list[Method]:
    """`methods` when they are the recipe's steps, one per step in order (what `check_recipe(recipe)` returns)."""
    got, want = [getattr(m, "name", type(m).__name__) for m in methods], [step.method for step in recipe.steps]
    if got != want or not all(isinstance(m, Method) for m in methods):
        raise TypeError(f"compress: methods must be check_recipe(recipe), one Method per step of recipe "
                        f"{recipe.name!r} ({want}), got {got}; or leave methods out")
    return methods


def check_recipe(recipe: Recipe) -> list[Method]:
    """Each step's method built from its arguments: unknown methods and bad arguments are found here, before a model
    is loaded (layer selectors that depend on the model's depth are checked by `Recipe.resolve` once it is)."""
    check_head_section(recipe.head)
    methods = []
    for i, step in enumerate(recipe.steps):
        try:
            methods.append(lookup_method(step.method).from_args(dict(step.args)))
        except AttnslimError as e:
            raise AttnslimError(f"recipe {recipe.name!r} step {i} ({step.method}): {e}") from e
    return methods

