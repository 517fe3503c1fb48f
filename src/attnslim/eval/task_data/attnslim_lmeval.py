"""lm-eval `custom_dataset` loader for the attnslim task YAMLs beside this file (imported by lm-eval by path).

lm-eval resolves `!function attnslim_lmeval.load` relative to the YAML, so the JSONL item files are found
wherever the package is installed; `dataset_path: json` would need an absolute `data_files` path instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(task_file: str, **_metadata: Any) -> Any:
    """{"test": Dataset} of one item file; lm-eval also passes the task metadata as keywords (ignored)."""
    import datasets

    text = (Path(__file__).parent / task_file).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
