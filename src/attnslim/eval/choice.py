"""Multiple-choice next-word items built deterministically from packaged text, scored at the last position.

Each item is a `context`-token prompt cut from a text split right before a whole-word token (a token that
decodes to " " + ≥ 4 letters); the choices are that word and `n_choices − 1` other whole-word tokens from the
same stretch of text (topical distractors), in a seeded random order. The answer is read from the next-token
distribution at the prompt's last position only — the paper's MMLU/BoolQ protocol (ATP App. D: argmax over the
candidate tokens), and the only scoring that is leak-free for ATP's non-causal layer (the answer is never
inside the sequence).

  acc       argmax of log p(choice | context)
  acc_norm  argmax of log p(choice | context) / len(" word" in UTF-8 bytes), as lm-eval's acc_norm
Random chance is 1 / n_choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from attnslim import _compat
from attnslim.data import bos_note, sequence_start, sequences_ending_at, token_ids
from attnslim.data.sources import describe_split
from attnslim.errors import AttnslimError


@dataclass(frozen=True)
class ChoiceItems:
    contexts: torch.Tensor  # (n, context) prompt token ids
    choices: torch.Tensor  # (n, n_choices) candidate next tokens
    labels: torch.Tensor  # (n,) index of the true next token in `choices`
    choice_bytes: torch.Tensor  # (n, n_choices) UTF-8 length of each candidate's text (acc_norm)
    description: str
    lengths: torch.Tensor | None = None  # (n,) real length of each row of `contexts`, which are then left-padded
    #                                      prompts of different lengths (eval/boolq.py); None: every row is whole


def last_position_logits(model: Any, items: ChoiceItems, rows: slice) -> torch.Tensor:
    """(b, vocab) next-token logits at the last prompt position of items[rows] (float32, on the model's output
    device). Whole rows run as one batch; left-padded rows (`lengths` set) run one at a time without their
    padding, so no pad token or attention mask ever reaches the model (ATP's layer mixes every position)."""
    device = _compat.input_device(model)
    contexts = items.contexts[rows]  # (b, context)
    if items.lengths is None:
        return model(input_ids=contexts.to(device), use_cache=False).logits[:, -1].float()
    out = [model(input_ids=row[row.numel() - int(n):][None].to(device), use_cache=False).logits[:, -1].float()
           for row, n in zip(contexts, items.lengths[rows].tolist(), strict=True)]  # each (1, vocab)
    return torch.cat(out)


@dataclass(frozen=True)
class ChoiceResult:
    acc: float
    acc_norm: float
    items: int
    chance: float
    description: str


def _word_tokens(ids: torch.Tensor, tokenizer: Any) -> dict[int, int]:
    """{token id: UTF-8 byte length} of the whole-word tokens (" " + ≥ 4 letters) occurring in ids."""
    words = {}
    for tid in torch.unique(ids).tolist():
        text = tokenizer.decode([tid])
        if text.startswith(" ") and len(text) >= 5 and text[1:].isalpha():
            words[tid] = len(text.encode("utf-8"))
    return words


def choice_items(
    source: str, tokenizer: Any, split: str = "eval", n: int = 200, context: int = 256, n_choices: int = 4,
    seed: int = 0,
) -> ChoiceItems:
    """`n` items with `context`-token prompts from one split of `source` (seeded, so identical for every model)."""
    if n < 1 or context < 1 or n_choices < 2:
        raise AttnslimError(f"need n ≥ 1, context ≥ 1, n_choices ≥ 2; got n={n}, context={context}, "
                            f"n_choices={n_choices}")
    ids = token_ids(source, split, tokenizer)
    words = _word_tokens(ids, tokenizer)
    is_word = torch.zeros(int(ids.max()) + 1, dtype=torch.bool)
    is_word[list(words)] = True
    positions = torch.nonzero(is_word[ids[context:]]).flatten() + context  # candidate answer positions
    if positions.numel() < n:
        raise AttnslimError(f"the {source!r} {split} split has only {positions.numel()} usable answer positions "
                            f"for context={context}; lower n or context")
    gen = torch.Generator().manual_seed(seed)
    ends, choices, labels, sizes = [], [], [], []
    for p in positions[torch.randperm(positions.numel(), generator=gen)].tolist():
        answer = int(ids[p])
        nearby = ids[max(0, p - context) : p + context]
        pool = [t for t in torch.unique(nearby[is_word[nearby]]).tolist() if t != answer]
        if len(pool) < n_choices - 1:
            continue
        picks = [pool[i] for i in torch.randperm(len(pool), generator=gen)[: n_choices - 1].tolist()]
        label = int(torch.randint(n_choices, (1,), generator=gen))
        options = picks[:label] + [answer] + picks[label:]
        ends.append(p)
        choices.append(options)
        labels.append(label)
        sizes.append([words[t] for t in options])
        if len(labels) == n:
            break
    if len(labels) < n:
        raise AttnslimError(f"could build only {len(labels)} of {n} items from {source!r} {split}; lower n")
    start = sequence_start(tokenizer)
    desc = (f"{n} next-word items, {n_choices} choices, {context}-token prompts from "
            f"{describe_split(source, split)}{bos_note(start)} (seed {seed})")
    contexts = sequences_ending_at(ids, ends, context, start)  # (n, context), each a sequence ending before its answer
    return ChoiceItems(contexts, torch.tensor(choices), torch.tensor(labels), torch.tensor(sizes), desc)


@torch.no_grad()
def choice_accuracy(model: Any, items: ChoiceItems, batch_size: int = 4, progress: bool = True) -> ChoiceResult:
    """acc / acc_norm of `model` on `items`, from the next-token log-probabilities at the last prompt position."""
    correct = correct_norm = 0
    n = items.contexts.shape[0]
    for start in tqdm(range(0, n, batch_size), desc="choice", disable=not progress, leave=False):
        rows = slice(start, start + batch_size)
        logp = last_position_logits(model, items, rows).log_softmax(-1).cpu()  # (b, vocab)
        scores = logp.gather(-1, items.choices[start : start + batch_size])  # (b, n_choices)
        labels = items.labels[start : start + batch_size]
        correct += int((scores.argmax(-1) == labels).sum())
        norm = scores / items.choice_bytes[start : start + batch_size]
        correct_norm += int((norm.argmax(-1) == labels).sum())
    return ChoiceResult(acc=correct / n, acc_norm=correct_norm / n, items=n,
                        chance=1.0 / items.choices.shape[1], description=items.description)
