"""`compress(model, tokenizer, recipe)`: the one orchestrator. Mutates the model in place."""

from __future__ import annotations

import copy
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attnslim.adapters import get_adapter
from attnslim.bench import kv_bytes_per_token
from attnslim.data import calib_windows
from attnslim.errors import AttnslimError
from attnslim.methods import METHODS, Method, lookup_method
from attnslim.pipeline import run_step
from attnslim.recipe import Recipe, fingerprint, recipe_to_dict, rest_layers
from attnslim.train.heal import HealConfig, heal


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


def compress(model: Any, tokenizer: Any, recipe: Recipe, progress: bool = True) -> CompressionReport:
    """Apply every step of `recipe` to `model` (in place) and report what changed."""
    start = time.time()
    adapter = get_adapter(model)
    _refuse_compressed(model)
    steps = recipe.resolve(adapter.num_layers(), _methods())
    before, kv_before = adapter.param_groups(), kv_bytes_per_token(model)
    cal = recipe.calibration
    windows = calib_windows(cal.source, tokenizer, cal.windows, cal.seq_len, cal.seed)
    done: list[dict[str, Any]] = []
    methods = check_recipe(recipe)
    # the teacher of every training step and of the heal: the model before the first step, so a later step
    # distils towards the original and also corrects what earlier steps lost (progressive conversion)
    trains = recipe.heal is not None or any(method.trains for method in methods)
    original = _frozen_copy(model) if trains else None
    for (step, candidates), method in zip(steps, methods, strict=True):
        converted = {int(k) for d in done for k in d["plan"]["layers"]}
        layers = rest_layers(adapter.num_layers(), converted) if candidates is None else candidates
        with torch.no_grad():
            plan = run_step(model, adapter, method, layers, windows.ids, cal.batch_size, progress)
        if method.trains:
            plan["training"] = method.train_step(model, tokenizer, original, progress)
        done.append({"method": step.method, "args": method.args(), "candidates": layers, "plan": plan})
    healed = None
    if recipe.heal is not None:  # `original` was kept above
        healed = heal(model, original, tokenizer, HealConfig.from_dict(recipe.heal), progress)
    del original
    kv_after = kv_bytes_per_token(model)
    return CompressionReport(
        recipe=recipe_to_dict(recipe), recipe_fingerprint=fingerprint(recipe), steps=done,
        calibration={"description": windows.description, "tokens": windows.n_tokens,
                     "fingerprint": windows.fingerprint()},
        params_before=before, params_after=adapter.param_groups(),
        kv_bytes_per_token_before=kv_before["total"], kv_bytes_per_token_after=kv_after["total"],
        kv_bytes_per_layer_dense=kv_before["per_layer"], kv_bytes_per_layer_after=kv_after["per_layer"],
        seconds=time.time() - start, peak_rss_mb=peak_rss_mb(), versions=library_versions(), heal=healed,
        no_decode_layers=kv_after["no_decode"],
    )


def _refuse_compressed(model: Any) -> None:
    """A model that already holds attnslim modules cannot be compressed again: the new report would record only the
    new steps, so the saved result could not load."""
    from attnslim.modules import MODULES

    held = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in MODULES})
    if held:
        raise AttnslimError(f"the model already holds attnslim modules ({', '.join(held)}); compress the original "
                            "model with one recipe that holds all the steps (a recipe may have several steps)")


def _frozen_copy(model: Any) -> Any:
    teacher = copy.deepcopy(model).eval()
    teacher.requires_grad_(False)
    return teacher


def _methods() -> dict[str, type]:
    return dict(METHODS)


def check_recipe(recipe: Recipe) -> list[Method]:
    """Each step's method built from its arguments: unknown methods and bad arguments are found here, before a model
    is loaded (layer selectors that depend on the model's depth are checked by `Recipe.resolve` once it is)."""
    methods = []
    for i, step in enumerate(recipe.steps):
        try:
            methods.append(lookup_method(step.method).from_args(dict(step.args)))
        except AttnslimError as e:
            raise AttnslimError(f"recipe {recipe.name!r} step {i} ({step.method}): {e}") from e
    return methods

