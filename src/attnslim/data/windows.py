"""Token windows: fixed evaluation windows and a seeded sampler of calibration windows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from attnslim.data.sources import describe_split, load_text, mixture
from attnslim.errors import AttnslimError

MAX_SEQ_LEN = 32768


@dataclass(frozen=True)
class TokenWindows:
    """(n, seq_len) token ids plus where they came from (for reports)."""

    ids: torch.Tensor
    source: str
    split: str
    description: str

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.ids.numpy().tobytes()).hexdigest()[:16]


def check_lengths(seq_len: int, tokens: int | None = None) -> None:
    if not 2 <= seq_len <= MAX_SEQ_LEN:
        raise AttnslimError(f"seq_len={seq_len} out of range; use 2..{MAX_SEQ_LEN} (typical: 512)")
    if tokens is not None and tokens < seq_len:
        raise AttnslimError(f"tokens={tokens} is smaller than one window (seq_len={seq_len}); use tokens >= seq_len")


@lru_cache(maxsize=16)
def _token_ids(source: str, split: str, tokenizer_key: int, tokenizer: Any) -> torch.Tensor:
    text = load_text(source, split)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None:
        ids = [bos, *ids]
    return torch.tensor(ids, dtype=torch.long)


def token_ids(source: str, split: str, tokenizer: Any) -> torch.Tensor:
    """All token ids of a split, 1-D (memoised per tokenizer object)."""
    return _token_ids(source, split, id(tokenizer), tokenizer)


def eval_windows(source: str, tokenizer: Any, tokens: int = 8192, seq_len: int = 512) -> TokenWindows:
    """The first `tokens // seq_len` non-overlapping windows of the evaluation split (same for every model)."""
    check_lengths(seq_len, tokens)
    ids = token_ids(source, "eval", tokenizer)
    n = tokens // seq_len
    if ids.numel() < n * seq_len:
        most = ids.numel() // seq_len * seq_len
        fix = (f"lower --tokens to at most {most}" if most else
               f"lower --seq-len below {ids.numel()} or give a longer text")
        raise AttnslimError(
            f"the {source!r} evaluation split has {ids.numel()} tokens, fewer than the {n * seq_len} requested "
            f"({n} windows of {seq_len}); {fix}"
        )
    desc = f"{describe_split(source, 'eval')}, first {n}x{seq_len} tokens"
    return TokenWindows(ids[: n * seq_len].view(n, seq_len), source, "eval", desc)


def calib_windows(source: str, tokenizer: Any, n: int, seq_len: int, seed: int = 0) -> TokenWindows:
    """`n` windows of `seq_len` tokens drawn from the calibration split with a seeded generator.

    A mixture "wiki+c4" takes windows round-robin from each part's calibration split (window k from part
    k mod parts), each part with its own generator seeded `seed`, so a part's windows do not depend on the others.
    """
    check_lengths(seq_len)
    if n < 1:
        raise AttnslimError(f"number of calibration windows must be >= 1, got {n}")
    parts = mixture(source)
    counts = [len(range(j, n, len(parts))) for j in range(len(parts))]
    drawn = [_draw(p, tokenizer, c, seq_len, seed) for p, c in zip(parts, counts, strict=True) if c]
    order = [drawn[k % len(parts)][k // len(parts)] for k in range(n)]
    desc = " + ".join(f"{describe_split(p, 'calib')}, {c}x{seq_len} tokens" for p, c in zip(parts, counts, strict=True)
                      if c)
    return TokenWindows(torch.stack(order), source, "calib", f"{desc}, seed {seed}")


def _draw(source: str, tokenizer: Any, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, seq_len) windows at seeded random starts in one source's calibration split."""
    ids = token_ids(source, "calib", tokenizer)
    if ids.numel() < seq_len + 1:
        raise AttnslimError(
            f"the {source!r} calibration split has {ids.numel()} tokens, too short for one window of {seq_len}; "
            "use a shorter seq_len or a longer text"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
