"""Zero-shot tasks: shipped item files, lm-eval-equivalent scoring, CLI errors (no lm_eval needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from attnslim.errors import AttnslimError
from attnslim.eval import make_tasks
from attnslim.eval import tasks as T
from attnslim.eval.tasks import TAG, TASK_DIR, Request, encode_pair, evaluate_tasks, load_items, resolve_tasks


class CharTokenizer:
    """One token per character (ids < 128): enough to drive tiny random models."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]


def naive_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """One request alone, full logits, as written in lm-eval's docs: sum log p(cont_k | ctx, cont_<k)."""
    full = torch.tensor(context + continuation)
    logp = model(full[None, :-1]).logits[0].float().log_softmax(-1)  # (t - 1, vocab)
    pos = torch.arange(len(context) - 1, len(full) - 1)
    return float(logp[pos, torch.tensor(continuation)].sum())


def test_shipped_tasks_are_well_formed():
    assert T.task_names() == sorted(make_tasks.TASK_SPECS)
    for name in T.task_names():
        items = load_items(name)
        assert len(items) >= 100, name
        assert len({it["id"] for it in items}) == len(items)
        for it in items:
            assert it["context"] and it["context"] == it["context"].rstrip()
            assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4
            assert all(c and c == c.strip() for c in it["choices"])
            assert 0 <= it["label"] < 4
        labels = [it["label"] for it in items]
        assert max(labels.count(k) for k in range(4)) < 0.4 * len(items)  # answer positions balanced
        yaml = (TASK_DIR / f"{name}.yaml").read_text()
        assert f"task: {name}\n" in yaml and f"task_file: {name}.jsonl" in yaml
        assert "custom_dataset: !function attnslim_lmeval.load" in yaml
    assert (TASK_DIR / "attnslim_lmeval.py").exists()


def test_items_come_from_the_evaluation_split_only():
    from attnslim.data import load_text

    for name in T.task_names():
        source, kind = make_tasks.TASK_SPECS[name]
        text = load_text(source, "eval")
        for it in load_items(name, limit=30):
            assert it["context"] in text
            answer = it["choices"][it["label"]]
            assert it["context"] + " " + answer in text if kind == "nextsent" else answer in text


def test_nextsent_regeneration_is_byte_identical():
    for name, (_, kind) in make_tasks.TASK_SPECS.items():
        if kind == "nextsent":  # lastword needs the SmolLM2 tokenizer: see the real test below
            text = make_tasks.render(make_tasks.build_task(name))
            assert text == (TASK_DIR / f"{name}.jsonl").read_text(encoding="utf-8"), name
        assert make_tasks.task_yaml(name) == (TASK_DIR / f"{name}.yaml").read_text(encoding="utf-8")


@pytest.mark.real
def test_all_files_regenerate_byte_identical():
    assert make_tasks.main(["--check"]) == 0


def test_sentence_splitting_keeps_abbreviations_and_quotes():
    doc = 'Mr. Smith went to St. Louis. He said "Hi." Then U.S. troops left!\nA new line starts here.'
    spans = make_tasks.split_sentences(doc)
    assert [doc[s:e] for s, e in spans] == [
        "Mr. Smith went to St. Louis.", 'He said "Hi."', "Then U.S. troops left!", "A new line starts here.",
    ]


def test_resolve_tasks_and_unknown_names():
    assert resolve_tasks("attnslim_tiny_lastword, attnslim_wiki_lastword") == [
        "attnslim_tiny_lastword", "attnslim_wiki_lastword",
    ]
    assert resolve_tasks([TAG]) == T.task_names()
    with pytest.raises(AttnslimError, match=re.escape("known tasks: " + ", ".join(T.task_names()))):
        resolve_tasks(["nope"])
    with pytest.raises(AttnslimError, match="no task"):
        resolve_tasks("")


def test_encode_pair_moves_trailing_space_to_continuation():
    tok = CharTokenizer()
    ctx, cont = encode_pair(tok, "ab ", "c")
    assert ctx == tok.encode("ab") and cont == tok.encode(" c")
    with pytest.raises(AttnslimError):
        encode_pair(tok, "", "c")


def test_score_acc_and_acc_norm_as_lm_eval():
    items = [
        {"choices": ["aaaa", "b", "cc", "dd"], "label": 0},  # acc: b (-1) wins; acc_norm: aaaa (-2/4) wins
        {"choices": ["x", "y", "z", "w"], "label": 1},  # tie between 0 and 1: the first index wins (wrong)
    ]
    lls = [-2.0, -1.0, -3.0, -4.0, -1.0, -1.0, -5.0, -5.0]
    assert T.score(items, lls) == {"acc": 0.0, "acc_norm": 0.5, "n": 2}


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_loglikelihoods_match_one_request_at_a_time(llama, batch_size):
    gen = torch.Generator().manual_seed(0)
    requests = []
    for n_ctx, n_cont in [(5, 1), (5, 1), (9, 3), (2, 1), (7, 2), (12, 1)]:
        ctx = torch.randint(0, 128, (n_ctx,), generator=gen).tolist()
        requests.append(Request(tuple(ctx), tuple(torch.randint(0, 128, (n_cont,), generator=gen).tolist())))
    requests.append(Request(requests[0].context, ((requests[0].continuation[0] + 1) % 128,)))  # group of #0
    with torch.no_grad():
        want = [naive_loglikelihood(llama, list(r.context), list(r.continuation)) for r in requests]
        got = T.loglikelihoods(llama, requests, batch_size=batch_size, progress=False)
    assert got == pytest.approx(want, abs=1e-5)


def test_evaluate_tasks_on_a_tiny_model(llama):
    names = ["attnslim_tiny_lastword", "attnslim_wiki_nextsent"]
    result = evaluate_tasks(llama, CharTokenizer(), names, limit=3, batch_size=4, progress=False)
    assert list(result) == names
    for r in result.values():
        assert r["n"] == 3 and 0.0 <= r["acc"] <= 1.0 and 0.0 <= r["acc_norm"] <= 1.0
    with pytest.raises(AttnslimError, match="limit"):
        evaluate_tasks(llama, CharTokenizer(), names, limit=0)


def test_cli_unknown_task_lists_known_ones(capsys):
    from attnslim.cli import main

    assert main(["eval", "smollm2-135m", "--tasks", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "attnslim_tiny_nextsent" in err


@pytest.mark.real
def test_cli_tasks_alone_score_tasks_without_perplexity(capsys):
    """`eval --tasks` without --data runs the tasks only (it used to crash parsing the absent --data)."""
    import json

    from attnslim.cli import main

    assert main(["eval", "smollm2-135m", "--tasks", "attnslim_wiki_lastword", "--limit", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ppl"] == {} and result["tasks"]["attnslim_wiki_lastword"]["n"] == 4 and result["choice"] is None


def test_cli_tasks_lists_and_prints_the_include_path(capsys, tmp_path, monkeypatch):
    from attnslim.cli import main
    from attnslim.eval.standard import TASKS

    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path))
    assert main(["tasks", "--path"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder.startswith(str(tmp_path / "lm_eval_tasks"))  # written into the cache: absolute paths inside
    for name in T.task_names():  # the home-made tasks are included from the package's own YAMLs
        assert f"include: \"{TASK_DIR / name}.yaml\"" in (Path(folder) / "local" / f"{name}.yaml").read_text()
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*T.task_names(), *TASKS]) and "--include_path" in out


@pytest.mark.real
def test_dense_smollm2_beats_chance_on_lastword():
    from attnslim.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    result = evaluate_tasks(model, tokenizer, ["attnslim_tiny_lastword"], limit=24, progress=False)
    assert result["attnslim_tiny_lastword"]["acc"] >= 0.5


def test_items_are_json_lines():
    for name in T.task_names():
        for line in (TASK_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
            assert set(json.loads(line)) == {"id", "context", "choices", "label"}
