"""What a plan gives its user: the recipe as YAML (a header of comments says what was chosen and why) beside a
JSON report, a printed table, and `plan_and_compress` (the `compress --kv` command: plan, then compress the same
model in memory and record the plan, its costs and the budgets in compression.json)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from attnslim.calib.residency import Residency
from attnslim.errors import AttnslimError
from attnslim.offload.compute import compute_target
from attnslim.planner.routes import ANY
from attnslim.planner.run import PlanConfig, PlanResult, plan_model
from attnslim.recipe import recipe_to_dict
from attnslim.safe_files import write_text_atomic


def plan_table(report: dict[str, Any]) -> list[str]:
    """One line per layer (choice, KV bytes/token, params, KL alone) and the totals."""
    lines = [f"{'layer':>5}  {'choice':<10} {'KV B/tok':>9} {'params':>10} {'KL alone':>10}"]
    lines += [f"{r['layer']:>5}  {r['choice']:<10} {r['kv_bytes']:>9.0f} {r['params']:>10,} {r['kl']:>10.5f}"
              for r in report["layers"]]
    used = ", ".join(f"{k} {v:.4f}" for k, v in report["used"].items())
    budgets = ", ".join(f"{k} {v:g}" for k, v in report["budgets"].items())
    est = report["estimate"]
    lines.append(f"budgets {budgets}; used {used}; binding: {', '.join(report['binding']) or 'none'}")
    lines.append(f"KL per token: additive estimate {est['additive_first']:.5f}, measured whole "
                 f"{est['measured_first']:.5f} (x{est['measured_over_additive_first']:.2f})")
    starts = ", ".join(f"{name} {s['measured']:.5f}" for name, s in report["starts"].items())
    lines.append(f"starts measured whole: {starts}; refined from {report['start']}: {est['measured']:.5f} "
                 f"(additive {est['additive']:.5f})")
    if report["route"] != ANY:  # --engine vllm: the plan holds one route's kinds (planner/routes.py)
        other = "; ".join(f"{name} {r['measured']:.5f}" if "measured" in r else f"{name} not possible ({r['refused']})"
                          for name, r in report["routes"].items() if name != report["route"])
        lines.append(f"vLLM route: {report['route']}" + (f" (other routes: {other})" if other else ""))
    lines += [f"served by {how}" for how in report["serving"].values()]
    return lines


def plan_yaml(result: PlanResult) -> str:
    """The recipe as YAML under a comment header (the table): readable, editable, `compress --recipe` runs it."""
    header = ["# Written by `attnslim plan`: one step per candidate, the layers that chose it listed; kept layers are",
              "# in no step. Edit freely: compress validates it like any recipe. Why each layer got what it got:",
              *[f"#   {line}" for line in plan_table(result.report)]]
    body = yaml.safe_dump(recipe_to_dict(result.recipe), sort_keys=False, default_flow_style=None, width=110)
    return "\n".join(header) + "\n" + body


def check_plan_out(out: Path) -> None:
    """Refuse, before planning, an output the plan cannot be written to."""
    if out.suffix not in (".yaml", ".yml"):
        raise AttnslimError(f"--out {out} must end in .yaml (the plan is a recipe)")
    if not out.parent.is_dir():
        raise AttnslimError(f"--out {out}: the directory {out.parent} does not exist; create it or choose another")


def write_plan(result: PlanResult, out: Path) -> Path:
    """`out` (the recipe YAML) and its report beside it (`out` with suffix .report.json); returns the report path."""
    check_plan_out(out)
    report_path = out.with_suffix(".report.json")
    write_text_atomic(out, plan_yaml(result))
    write_text_atomic(report_path, json.dumps(result.report, indent=1, default=float))
    return report_path


def load_planned(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """The model the planner measures, whole on `device` in `dtype` (checked before loading: the device exists and
    computes in the dtype): a 7B-8B model plans on one GPU in bfloat16 (a larger one: `offloaded_for_plan`)."""
    from attnslim.models.load import load_model

    placed, torch_dtype = compute_target(device, dtype)
    model, tokenizer = load_model(name_or_path, torch_dtype)
    return model.to(placed), tokenizer


@contextmanager
def offloaded_for_plan(name_or_path: str, dtype: str = "float32", device: str = "cpu"
                       ) -> Iterator[tuple[Any, Any, Residency]]:
    """(skeleton, tokenizer, residency) of a local checkpoint whose weights stay on disk while it is planned
    (`plan --offload`): one decoder layer in memory at a time on `device`, plus the embeddings, final norm and
    head during the forwards that score candidates and plans. The residency would write converted layers to a
    scratch directory; the planner converts none for keeps, and the directory goes on exit."""
    from attnslim.adapters import get_adapter
    from attnslim.models.load import checkpoint_directory, read_checkpoint, skeleton
    from attnslim.offload import OffloadedLayers, WeightSource

    placed, torch_dtype = compute_target(device, dtype)
    checkpoint = read_checkpoint(checkpoint_directory(name_or_path))
    model = skeleton(checkpoint, torch_dtype)
    adapter = get_adapter(model)
    adapter.refuse_offload()
    with tempfile.TemporaryDirectory(prefix="attnslim-plan-layers-") as scratch:
        yield model, checkpoint.tokenizer, OffloadedLayers(model, adapter.decoder_layers(),
                                                           WeightSource(checkpoint.directory), Path(scratch), placed)


def plan_and_compress(name_or_path: str, cfg: PlanConfig, out: Path, overwrite: bool = False,
                      dtype: str = "float32", progress: bool = True, device: str = "cpu") -> tuple[PlanResult, Any]:
    """Plan `name_or_path` under `cfg`, compress it with the plan in memory on `device` and save it to `out`."""
    from attnslim.api import compress
    from attnslim.io import save

    model, tokenizer = load_planned(name_or_path, dtype, device)
    result = plan_model(model, tokenizer, cfg, progress)
    report = compress(model, tokenizer, result.recipe, progress, methods=result.methods,  # built once, by the plan
                      windows=result.windows)  # and drawn once: `self` text is sampled by the plan only
    measured = report.kv_bytes_per_token_after / report.kv_bytes_per_token_before
    result.report["kv_measured"] = measured
    if measured > cfg.kv:
        raise AttnslimError(f"internal: the planned model caches {measured:.4f} of the dense KV bytes, above the "
                            f"budget {cfg.kv:g}; nothing was saved. Please report this with the plan: "
                            f"{result.report['layers']}")
    extra = {"base_model": name_or_path, "compute": {"device": str(model.device), "dtype": dtype, "offload": False},
             "planner": result.report}
    save(model.to("cpu"), tokenizer, out, {**report.to_json(), **extra}, overwrite=overwrite)
    return result, report
