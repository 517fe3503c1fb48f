"""Build the zero-shot item files from the packaged evaluation splits, deterministically (seeded, no model).

    python -m attnslim.eval.make_tasks            # rewrite src/attnslim/eval/task_data/*.jsonl
    python -m attnslim.eval.make_tasks --check    # exit 1 if regenerating would change a shipped file

Two kinds of 4-way items, from the *evaluation* split only (the calibration split never appears in a task):

  nextsent  context = up to ~150 characters of a document ending at a sentence end; choices = the true next
            sentence (same line in the source, so " " is the true separator) and 3 sentences of similar length
            (0.67x-1.5x characters) drawn from other documents of the split.
  lastword  lambada-style cloze: context = the sentence up to its final word, after as many preceding sentences
            as fit in ~150 characters in all;
            choices = that word and 3 final words of other sentences of the same document (of the whole split
            when the document has too few; same capitalisation, ≥ 3 letters, not stop words): every choice is
            on topic and plausible at a sentence end.
            Every choice is one token of the SmolLM2 tokenizer after a space, so a model scores an item with one
            forward pass (lm-eval groups single-token continuations of one context too); other tokenizers still
            score correctly, only slower.

Items are text (lm-eval's (context, " " + choice) loglikelihood requests), shuffled with a per-task seed and
capped at MAX_ITEMS. Random chance is 0.25 on every task.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).parent / "task_data"
TASK_SPECS: dict[str, tuple[str, str]] = {  # task name -> (text source, kind)
    "attnslim_wiki_nextsent": ("wiki", "nextsent"),
    "attnslim_tiny_nextsent": ("tiny", "nextsent"),
    "attnslim_wiki_lastword": ("wiki", "lastword"),
    "attnslim_tiny_lastword": ("tiny", "lastword"),
}
SEED = 0
N_CHOICES = 4
MAX_ITEMS = 500
MAX_CONTEXT_CHARS = 150
TOKENIZER_MODEL = "smollm2-135m"  # only decides which words count as single tokens (lastword)
_STOP = set(
    "the and for but not you she her his him they them was were are its this that with from all one too out now "
    "any who had has have been more also very there then here what when where which will would could should did "
    "does our your their these those can may about into over some such only just other than said says went".split()
)
_WORD = re.compile(r"[A-Za-z]+")
_ABBREV = re.compile(r"(?:[A-Z]|Mr|Mrs|Ms|Dr|St|Jr|Sr|Mt|Rev|Prof|Gen|Col|Lt|Capt|No|Vol|Fig|ca|vs)\.")
_LAST = re.compile(r"^(?P<head>.*\S)\s(?P<word>[A-Za-z]+)[.!?]+[\"”’')]*$", re.DOTALL)

Span = tuple[int, int]  # [start, end) character offsets of one sentence inside its document
Item = dict[str, Any]


class _Rng:
    """Seeded choices built only on random.random(), whose sequence Python keeps stable across versions."""

    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def below(self, n: int) -> int:
        return min(int(self._r.random() * n), n - 1)

    def sample(self, pool: list[Any], k: int) -> list[Any]:
        pool = list(pool)
        for i in range(k):  # partial Fisher-Yates
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]

    def shuffle(self, items: list[Any]) -> list[Any]:
        return self.sample(items, len(items))


def split_sentences(doc: str) -> list[Span]:
    """Sentence spans: lines split after . ! ? (and closing quotes) before a capital, except after initials."""
    spans: list[Span] = []
    offset = 0
    for line in doc.split("\n"):
        start = 0
        for m in re.finditer(r"(?<=[.!?])(?P<q>[\"”’')]*)\s+(?=[\"“A-Z])", line):
            before = line[start : m.start()].split()
            last = before[-1] if before else ""
            if last.endswith(".") and (_ABBREV.fullmatch(last) or "." in last[:-1]):  # "Mr.", "U.S.": no end
                continue
            spans.append((offset + start, offset + m.end("q")))
            start = m.end()
        if line[start:].strip():
            spans.append((offset + start, offset + len(line.rstrip())))
        offset += len(line) + 1
    return [(s, s + len(doc[s:e].rstrip())) for s, e in spans if doc[s:e].strip()]


def good_sentence(text: str) -> bool:
    """A complete prose sentence: 6-40 words, capital or quote first, terminal punctuation last."""
    words = text.split()
    return (6 <= len(words) <= 40 and text[0] in "\"“ABCDEFGHIJKLMNOPQRSTUVWXYZ"
            and re.search(r"[.!?][\"”’')]*$", text) is not None)


def _context_start(spans: list[Span], i: int, end: int, at_least: int) -> int:
    """Start of the earliest sentence j < i (j <= i - at_least) with end - start <= MAX_CONTEXT_CHARS."""
    j = i - at_least
    while j > 0 and end - spans[j - 1][0] <= MAX_CONTEXT_CHARS:
        j -= 1
    return spans[j][0]


def nextsent_items(docs: list[str], rng: _Rng) -> list[Item]:
    sents = [split_sentences(d) for d in docs]
    pool = [(di, d[s:e]) for di, d in enumerate(docs) for s, e in sents[di] if good_sentence(d[s:e])]
    items, seen = [], set()
    for di, doc in enumerate(docs):
        for i in range(1, len(sents[di])):
            pe, (s, e) = sents[di][i - 1][1], sents[di][i]
            answer = doc[s:e]
            if not good_sentence(answer) or doc[pe:s] != " " or answer in seen:
                continue
            seen.add(answer)
            near = sorted({t for dj, t in pool if dj != di and 0.67 <= len(t) / len(answer) <= 1.5 and t != answer})
            if len(near) < N_CHOICES - 1:
                continue
            context = doc[_context_start(sents[di], i, pe, at_least=1) : pe]
            items.append(_item(context, answer, rng.sample(near, N_CHOICES - 1), rng))
    return items


def lastword_items(docs: list[str], rng: _Rng, single_token: Callable[[str], bool]) -> list[Item]:
    def usable(w: str) -> bool:
        return len(w) >= 3 and w.lower() not in _STOP and single_token(w)

    cloze = []  # (doc, sentence index, length before the final word, final word), first occurrence only
    seen = set()
    for di, doc in enumerate(docs):
        for i, (s, e) in enumerate(split_sentences(doc)):
            m = _LAST.match(doc[s:e])
            if good_sentence(doc[s:e]) and m is not None and usable(m["word"]) and doc[s:e] not in seen:
                seen.add(doc[s:e])
                cloze.append((di, i, len(m["head"]), m["word"]))
    finals = sorted({w for *_, w in cloze})  # sentence-final words of the split
    doc_finals = [sorted({w for dj, *_, w in cloze if dj == di}) for di in range(len(docs))]
    items = []
    for di, i, head_len, word in cloze:
        doc, spans = docs[di], split_sentences(docs[di])
        s = spans[i][0]
        others = [w for w in doc_finals[di] if w[0].isupper() == word[0].isupper() and w.lower() != word.lower()]
        if len({w.lower() for w in others}) < N_CHOICES - 1:  # short document: final words of the whole split
            others = [w for w in finals if w[0].isupper() == word[0].isupper() and w.lower() != word.lower()]
        others = sorted({w.lower(): w for w in others}.values())  # one spelling per word
        start = _context_start(spans, i + 1, s + head_len, at_least=1)  # preceding sentences that fit
        items.append(_item(doc[start : s + head_len], word, rng.sample(others, N_CHOICES - 1), rng))
    return items


def _item(context: str, answer: str, distractors: list[str], rng: _Rng) -> Item:
    label = rng.below(N_CHOICES)
    return {"context": context, "choices": distractors[:label] + [answer] + distractors[label:], "label": label}


def _single_token_check() -> Callable[[str], bool]:
    from transformers import AutoTokenizer

    from attnslim.models.load import ensure_cached
    from attnslim.models.zoo import ZOO

    tok = AutoTokenizer.from_pretrained(ensure_cached(ZOO[TOKENIZER_MODEL]))
    cache: dict[str, bool] = {}

    def check(word: str) -> bool:
        if word not in cache:
            cache[word] = len(tok.encode(" " + word, add_special_tokens=False)) == 1
        return cache[word]

    return check


def build_task(name: str, single_token: Callable[[str], bool] | None = None) -> list[Item]:
    """The items of one task (shuffled, capped, with ids); `single_token` defaults to the SmolLM2 check."""
    from attnslim.data.sources import _documents

    source, kind = TASK_SPECS[name]
    docs = _documents(source)
    n_eval = max(1, round(len(docs) * 0.1))  # the evaluation split of attnslim.data (last 10% of documents)
    docs = docs[len(docs) - n_eval :]
    rng = _Rng(zlib.crc32(name.encode()) ^ SEED)
    if kind == "nextsent":
        items = nextsent_items(docs, rng)
    else:
        items = lastword_items(docs, rng, single_token or _single_token_check())
    items = rng.shuffle(items)[:MAX_ITEMS]
    return [{"id": f"{name}-{k:04d}", **item} for k, item in enumerate(items)]


def render(items: list[Item]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def task_yaml(name: str) -> str:
    """The lm-eval task config of one task (its data come from attnslim_lmeval.py beside it)."""
    source, kind = TASK_SPECS[name]
    return (
        f"# generated by python -m attnslim.eval.make_tasks: {kind} items from the {source} evaluation split\n"
        f"task: {name}\ntag: attnslim_zeroshot\n"
        f"custom_dataset: !function attnslim_lmeval.load\ndataset_kwargs:\n  task_file: {name}.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnslim.eval.make_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=TASK_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the files in --out, write nothing")
    args = parser.parse_args(argv)
    check = _single_token_check()
    changed = []
    for name in TASK_SPECS:
        files = {f"{name}.jsonl": render(build_task(name, check)), f"{name}.yaml": task_yaml(name)}
        for filename, text in files.items():
            path = args.out / filename
            if args.check:
                if not path.exists() or path.read_text(encoding="utf-8") != text:
                    changed.append(path)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"{path}: {text.count(chr(10))} lines")
    for path in changed:
        print(f"would change: {path}", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
