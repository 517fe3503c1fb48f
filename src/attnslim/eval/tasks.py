"""Zero-shot multiple-choice tasks scored exactly as lm-eval's `multiple_choice` tasks (acc, acc_norm).

The item files (task_data/*.jsonl, built by `python -m attnslim.eval.make_tasks`) are also registered as local
lm-eval tasks (task_data/*.yaml), so for a saved directory DIR

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path TASK_DIR --tasks T
    attnslim eval DIR --tasks T

give the same acc / acc_norm. What is mirrored from lm-eval 0.4 (HFLM, TemplateLM, ConfigurableTask):
  * requests: (context, " " + choice) per choice; trailing whitespace of the context moves to the continuation;
    context + continuation is tokenized together and split after the tokens of the context alone.
  * scoring: log-softmax of the logits of `(context + continuation)[:-1]`, summed over the continuation tokens;
    acc = argmax of the sums, acc_norm = argmax of sum / len(choice) in characters, first index on ties.
  * batching: requests of all tasks pooled, grouped by context + continuation[:-1] (one forward for single-token
    choices of one context), sorted by length descending, right-padded with token 0, no attention mask; so with
    the same batch size the batches are the same as lm-eval's, even for modules that are not strictly causal.
Only the logits of the scored positions are computed (`_compat.last_logits`); the values are the same positions'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from attnslim import _compat
from attnslim.errors import AttnslimError
from attnslim.eval.causal import require_causal

TASK_DIR = Path(__file__).parent / "task_data"
TAG = "attnslim_zeroshot"  # lm-eval tag (and `attnslim eval --tasks` alias) for every task in TASK_DIR
DEFAULT_BATCH_SIZE = 16


def task_names() -> list[str]:
    """The shipped tasks (one JSONL item file each)."""
    return sorted(p.stem for p in TASK_DIR.glob("*.jsonl"))


def resolve_tasks(names: list[str] | str) -> list[str]:
    """Validate task names (a list or "a,b"); the tag expands to every task. Unknown names list the known ones."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    known = task_names()
    out: list[str] = []
    for name in names:
        expanded = known if name == TAG else [name]
        for task in expanded:
            if task not in known:
                raise AttnslimError(f"unknown task {task!r}; known tasks: {', '.join(known)} (or {TAG} for all)")
            if task not in out:
                out.append(task)
    if not out:
        raise AttnslimError(f"no task given; known tasks: {', '.join(known)} (or {TAG} for all)")
    return out


def load_items(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` items of a task (lm-eval's --limit takes the first docs too)."""
    (name,) = resolve_tasks([name])
    lines = (TASK_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line]
    return items if limit is None else items[:limit]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal `_encode_pair`: move trailing spaces of the context, encode the whole, split."""
    if not context:
        raise AttnslimError("empty contexts are not supported (every shipped item has one)")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    if len(whole) <= len(context_ids):
        raise AttnslimError(f"continuation {continuation!r} encodes to no token after context {context[-40:]!r}")
    return context_ids, whole[len(context_ids) :]


@dataclass(frozen=True)
class Request:
    context: tuple[int, ...]
    continuation: tuple[int, ...]

    @property
    def key(self) -> tuple[int, ...]:  # lm-eval's group key: requests with one key share one forward
        return self.context + self.continuation[:-1]


def _max_length(model: Any) -> int:
    config = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return 2048


@torch.no_grad()
def loglikelihoods(
    model: Any, requests: list[Request], batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True
) -> list[float]:
    """Sum of log p(continuation | context) per request, computed and batched as lm-eval's HFLM does."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(req.key, []).append(i)
    # one representative per group (first with the longest continuation), longest sequences first
    reps = [max(idx, key=lambda i: len(requests[i].continuation)) for idx in groups.values()]
    reps.sort(key=lambda i: (-len(requests[i].key) - 1, requests[i].context + requests[i].continuation))
    device = _compat.input_device(model)
    max_len = _max_length(model)
    out = [0.0] * len(requests)
    for start in tqdm(range(0, len(reps), batch_size), desc="tasks", disable=not progress, leave=False):
        batch = reps[start : start + batch_size]
        inps = [(requests[i].context + requests[i].continuation)[-(max_len + 1) :][:-1] for i in batch]
        width = max(len(x) for x in inps)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # (b, t) right-padded with 0 as lm-eval
        for row, x in enumerate(inps):
            ids[row, : len(x)] = torch.tensor(x)
        # first scored position over the batch; positions [first, width) are the only logits needed
        first = min(len(x) - len(requests[i].continuation) for x, i in zip(inps, batch, strict=True))
        logits = model(ids.to(device), **_compat.last_logits(model, width - first)).logits  # (b, t_kept, vocab)
        offset = width - logits.shape[1]  # position of logits[:, 0]
        logp = torch.log_softmax(logits, dim=-1)  # in the logits' dtype, as lm-eval's default softmax_dtype
        for row, (x, i) in enumerate(zip(inps, batch, strict=True)):
            end = len(x) - offset
            sel = logp[row, end - len(requests[i].continuation) : end]  # (cont, vocab)
            for j in groups[requests[i].key]:
                cont = torch.tensor(requests[j].continuation, device=sel.device)
                # lm-eval gathers from the first len(cont) selected positions; they differ from the last ones
                # only if a group member splits context/continuation elsewhere, which no shipped item does
                out[j] = float(sel[: len(cont)].gather(-1, cont[:, None]).squeeze(-1).sum())
    return out


def score(items: list[dict[str, Any]], lls: list[float]) -> dict[str, float | int]:
    """acc / acc_norm over items from the per-choice loglikelihoods (flattened in item, choice order)."""
    acc = acc_norm = 0.0
    pos = 0
    for item in items:
        choices = item["choices"]
        ll = np.array(lls[pos : pos + len(choices)])
        pos += len(choices)
        lengths = np.array([float(len(c)) for c in choices])
        acc += float(np.argmax(ll) == item["label"])
        acc_norm += float(np.argmax(ll / lengths) == item["label"])
    n = len(items)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n}


def evaluate_tasks(
    model: Any, tokenizer: Any, names: list[str], limit: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
) -> dict[str, dict[str, float | int]]:
    """{task: {"acc", "acc_norm", "n"}} for `model` on the first `limit` items of each task (all if None); the
    continuation is inside the input, so models with non-causal layers are refused (eval/causal.py)."""
    names = resolve_tasks(names)
    require_causal(model, "zero-shot tasks")
    if limit is not None and limit < 1:
        raise AttnslimError(f"limit must be >= 1 (or None for every item), got {limit}")
    items = {name: load_items(name, limit) for name in names}
    requests = [
        Request(*map(tuple, encode_pair(tokenizer, item["context"], " " + choice)))
        for name in names for item in items[name] for choice in item["choices"]
    ]
    lls = loglikelihoods(model, requests, batch_size, progress)
    results, pos = {}, 0
    for name in names:
        count = sum(len(item["choices"]) for item in items[name])
        results[name] = score(items[name], lls[pos : pos + count])
        pos += count
    return results
