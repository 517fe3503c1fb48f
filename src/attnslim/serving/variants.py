"""The variants that the serving tests and benchmark serve (built in attnslim's own environment), of SmolLM2 by
default and of any packaged model on request (benchmarks/serve.py --model: the 1.5B model's dense and NBL-12).

`build(name, out, model_name)` writes one servable directory: "dense" as a plain transformers checkpoint,
"mla-deepseek" as the DeepSeek-V3 export of an all-MLA output (kv_lora_rank padded to 512: the only size vLLM's CPU
MLA kernel runs), "plan-vllm-kvF" as `attnslim compress --kv F --engine vllm --calib-source wiki` writes it
(planned, then compressed: a plan one vLLM route serves, on SmolLM2 the plugin's keep/nbl/drop), the others as
attnslim outputs (`attnslim.save`). Calibration is small (`WINDOWS` windows of `SEQ_LEN` tokens; the planned
variants' is PLANNED_CALIBRATION): the serving checks compare vLLM with HF on the *same* weights, and speed or KV
capacity do not depend on how well the maps were fitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError
from attnslim.mla_widths import VLLM_CPU_LORA_RANK
from attnslim.recipe import Calibration

MODEL = "smollm2-135m"
WINDOWS, SEQ_LEN = 16, 256
VARIANTS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "dense": None,
    "nbl-6": ("nbl", {"m": 6, "criterion": "similarity", "input": "normed", "sequential": False}),
    "nbl-12": ("nbl", {"m": 12, "criterion": "similarity", "input": "normed", "sequential": False}),
    "nbl-6-residual": ("nbl", {"m": 6, "criterion": "similarity", "input": "residual", "sequential": False}),
    "drop-6": ("drop", {"count": 6, "select": "similarity"}),
    "mla-deepseek": ("mla", {"kv_ratio": 0.5, "rope_dims": 64, "layout": "deepseek"}),
}
EXPORTED = {"mla-deepseek": VLLM_CPU_LORA_RANK}  # variant -> kv_lora_rank of its DeepSeek-V3 export
PLANNED = {"plan-vllm-kv0.5": 0.5, "plan-vllm-kv0.25": 0.25}  # variant -> the KV budget of `plan --engine vllm`
# The planned variants' calibration: the planner's size (32 windows of 512), on wiki as benchmarks/plan.py --engine vllm
# plans, so that the served plan is the one whose quality that benchmark reports
PLANNED_CALIBRATION = Calibration(source="wiki")
KNOWN = (*VARIANTS, *PLANNED)


def build(name: str, out: Path, model_name: str = MODEL) -> Path:
    """Compress the packaged model `model_name` (float32) as variant `name` and save it to `out` (which must not
    exist)."""
    from attnslim.api import compress
    from attnslim.io import save
    from attnslim.models import load_model
    from attnslim.outdir import staged_output
    from attnslim.recipe import recipe_from_dict

    if name not in KNOWN:
        raise AttnslimError(f"unknown serving variant {name!r}; known: {', '.join(KNOWN)}")
    if name in PLANNED:
        return _planned(PLANNED[name], out, model_name)
    model, tokenizer = load_model(model_name)
    step = VARIANTS[name]
    if step is None:
        with staged_output(out, overwrite=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        return out
    method, args = step
    recipe = recipe_from_dict({
        "name": f"serve-{name}",
        "calibration": {"source": "wiki", "windows": WINDOWS, "seq_len": SEQ_LEN, "seed": 0},
        "steps": [{"method": method, "layers": "all", "args": args}],
    })
    report = compress(model, tokenizer, recipe, progress=False)
    if name in EXPORTED:
        from attnslim.export import ExportOptions, export_deepseek

        export_deepseek(model, tokenizer, out, ExportOptions(kv_lora_rank=EXPORTED[name]))
        return out
    return save(model, tokenizer, out, report.to_json())


def _planned(kv: float, out: Path, model_name: str) -> Path:
    """`attnslim compress MODEL --kv KV --engine vllm --calib-source wiki`, every other planner setting its default
    (the calibration's size too, not the other variants' small one): the very plan whose quality benchmarks/plan.py
    --engine vllm reports, which calibrates on wiki as the single-method rows it is compared with do."""
    from attnslim.planner.output import plan_and_compress
    from attnslim.planner.run import PlanConfig

    plan_and_compress(model_name, PlanConfig(kv=kv, engine="vllm", calibration=PLANNED_CALIBRATION), out,
                      progress=False)
    return out
