"""A seeded synthetic classification task whose attention inputs are low-rank by construction (ATP notes §7 #18).

Each sequence is `length - 1` body tokens followed by a fixed query token; the body uses only `distinct` token ids
(one MARKER id in positives, none in negatives), each repeated a random number of times. Identical tokens give
identical rows of the first layer's input (embedding, then RMSNorm), so that input X (L, d) has rank
distinct + 1 ≤ L: planted, not learned. The label asks whether the marker occurs; the marker's count is drawn like
the others', so its direction is the i-th largest singular direction for a random i. ATP keeping r components sees
the marker (for orthogonal-ish embeddings, σ ≈ √count) only when it is among the r most frequent tokens: fewer
principal keys lose the label for more positives, which is the ordering the paper's Table 3 shows (Orig ≳ 1/2 ≥
1/4 ≥ 1/8). The answer is read as the paper reads BoolQ: next-token logits at the last position, argmax over the
two candidate ids.

Why here (tests/) and not under src/attnslim: it is a fixture for one paper property, trained on a random-init
tiny model in seconds; no benchmark or user-facing command needs it.
"""

from __future__ import annotations

import torch
from torch import nn

MARKER, QUERY, NO, YES = 0, 1, 2, 3  # reserved ids; the body's other tokens are drawn from FIRST_FILLER..vocab-1
FIRST_FILLER = 4


def make_batch(n: int, gen: torch.Generator, vocab: int = 64, length: int = 32, distinct: int = 10
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (n, length) and labels (n,) in {0, 1}, half positives. Every body token occurs ≥ once; counts are a
    uniform random composition of length - 1 into `distinct` parts."""
    body = length - 1
    ids = torch.empty(n, length, dtype=torch.long)
    labels = torch.arange(n) % 2
    for i in range(n):
        fillers = FIRST_FILLER + torch.randperm(vocab - FIRST_FILLER, generator=gen)[:distinct]
        if labels[i]:
            fillers[0] = MARKER
        cuts = torch.sort(torch.randperm(body - 1, generator=gen)[: distinct - 1] + 1).values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([body])]))  # (distinct,), each ≥ 1
        seq = torch.repeat_interleave(fillers, counts)
        ids[i, :body] = seq[torch.randperm(body, generator=gen)]
        ids[i, body] = QUERY
    return ids, labels


def answer_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(n, 2) logits of the NO / YES ids at the last position (the paper's BoolQ scoring)."""
    return model(input_ids=ids, use_cache=False).logits[:, -1, [NO, YES]]


def train(model: nn.Module, steps: int, gen: torch.Generator, lr: float = 3e-3, batch: int = 32) -> nn.Module:
    """Adam on cross-entropy over the two candidates, every parameter trained (the paper's BERT recipe)."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        ids, labels = make_batch(batch, gen)
        loss = nn.functional.cross_entropy(answer_logits(model, ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> float:
    return float((answer_logits(model, ids).argmax(-1) == labels).float().mean())
