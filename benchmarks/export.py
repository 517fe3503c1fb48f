"""The DeepSeek-V3 export's accuracy: the packaged `mla-deepseek` recipe, then `attnslim export` in float32 and in
bfloat16 at kv_lora_rank 512 (what vLLM's CPU MLA kernel serves), each verified by the export itself (transformers
alone loads the output; logits compared with the attnslim model's on wiki text; OUT/attnslim-export.json).
Runs the CLI as a user would, in subprocesses.

    .venv/bin/python benchmarks/export.py --work /tmp/attnslim-export
writes benchmarks/results/export.json (BENCHMARKS.md section "Export to DeepSeek-V3").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, environment  # noqa: E402

CLI = [sys.executable, "-m", "attnslim"]
EXPORTS = {"float32": [], "bfloat16-512": ["--dtype", "bfloat16", "--kv-lora-rank", "512"]}


def run(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([*CLI, *args], check=True, stdout=subprocess.DEVNULL)
    return round(time.perf_counter() - start, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/attnslim-export"))
    ap.add_argument("--recipe", default="mla-deepseek")
    a = ap.parse_args()
    source = a.work / a.recipe
    out = {"environment": environment(), "recipe": a.recipe, "exports": {}}
    out["compress_seconds"] = run(["compress", "--recipe", a.recipe, "--out", str(source), "--overwrite"])
    out["source_rms_norm_eps"] = json.loads((source / "config.json").read_text())["rms_norm_eps"]
    for name, extra in EXPORTS.items():
        target = a.work / f"export-{name}"
        seconds = run(["export", str(source), "--to", "deepseek-v3", "--out", str(target), "--overwrite", *extra])
        report = json.loads((target / "attnslim-export.json").read_text())
        out["exports"][name] = {"command": f"attnslim export OUT --to deepseek-v3 {' '.join(extra)}".strip(),
                                "seconds": seconds, **report}
        print(name, json.dumps({k: report[k] for k in ("relative_logit_error", "top1_agreement")}), flush=True)
    (RESULTS / "export.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS / 'export.json'}")


if __name__ == "__main__":
    main()
