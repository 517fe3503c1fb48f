"""attnslim: cheaper attention for pretrained Hugging Face LLMs.

The public API (everything else is internal and may change):

    from attnslim import compress, save, load, load_model, load_recipe, Recipe, Step, PlanConfig, plan_model

    model, tokenizer = load_model("smollm2-135m")
    report = compress(model, tokenizer, load_recipe("svdllm"))   # in place
    save(model, tokenizer, "out/svdllm", report.to_json())
    model, tokenizer = load("out/svdllm")

    plan = plan_model(model, tokenizer, PlanConfig(kv=0.5))   # a budget instead of a recipe (`attnslim plan`);
    report = compress(model, tokenizer, plan.recipe, windows=plan.windows)  # the plan's calibration windows
    set_cpu_linear(model, "onednn")   # float32 linear layers on oneDNN for CPU inference (modules/cpu_linear.py)

Names are imported on first use, so `import attnslim` (and the CLI's start-up) does not pay for torch and
transformers until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "compress": "attnslim.api",
    "CompressionReport": "attnslim.api",
    "save": "attnslim.api_checks",  # attnslim.io's and attnslim.models' functions with their arguments checked
    "load": "attnslim.api_checks",
    "load_model": "attnslim.api_checks",
    "load_recipe": "attnslim.recipe",
    "Recipe": "attnslim.recipe",
    "Step": "attnslim.recipe",
    "Calibration": "attnslim.recipe",
    "AttnslimError": "attnslim.errors",
    "set_cpu_linear": "attnslim.modules.cpu_linear",
    "plan_model": "attnslim.planner.run",
    "PlanConfig": "attnslim.planner.run",
    "PlanResult": "attnslim.planner.run",
}
__all__ = ["AttnslimError", "Calibration", "CompressionReport", "PlanConfig", "PlanResult", "Recipe", "Step",
           "__version__", "compress", "load", "load_model", "load_recipe", "plan_model", "save", "set_cpu_linear"]

if TYPE_CHECKING:
    from attnslim.api import CompressionReport, compress
    from attnslim.api_checks import load, load_model, save
    from attnslim.errors import AttnslimError
    from attnslim.modules.cpu_linear import set_cpu_linear
    from attnslim.planner.run import PlanConfig, PlanResult, plan_model
    from attnslim.recipe import Calibration, Recipe, Step, load_recipe


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'attnslim' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
