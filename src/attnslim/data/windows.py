"""Token windows: fixed evaluation windows and a seeded sampler of calibration windows.

Every window is a sequence of its own, so where the tokenizer starts sequences with a BOS token (Gemma's <bos>;
SmolLM2's adds none) every window starts with it, followed by seq_len − 1 tokens of text. A model trained with a
BOS uses it as its attention sink: Gemma-3 270M scored on windows that start mid-text without it has two to three
and a half times its perplexity (docs/benchmarks-archive.md: the dense rows of "MLA on Gemma-3 270M" and of its "windows
without <bos>").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from attnslim.data.generated import SELF, generated_windows
from attnslim.data.sources import describe_split, load_text, mixture
from attnslim.errors import AttnslimError

MAX_SEQ_LEN = 32768
MAX_GENERATED = 4096  # windows the part 'self' may sample (each one a generation of seq_len tokens)
DRAW_FACTOR = 4  # a draw of seeded windows may cover a calibration split's tokens at most this many times over


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
    return torch.tensor(ids, dtype=torch.long)


def token_ids(source: str, split: str, tokenizer: Any) -> torch.Tensor:
    """All token ids of a split's text, 1-D, no special tokens (memoised per tokenizer object)."""
    return _token_ids(source, split, id(tokenizer), tokenizer)


def sequence_start(tokenizer: Any) -> int | None:
    """The token id the tokenizer starts every sequence with (its BOS where it adds one), or None. Asked of the
    tokenizer's behaviour, not its `add_bos_token` flag: Gemma-3's is False in transformers 5.x, yet its
    special tokens start every sequence with <bos>."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def _as_sequences(text: torch.Tensor, start: int | None) -> torch.Tensor:
    """(n, w) windows of text -> (n, w + 1) with `start` in front, or unchanged where start is None."""
    return text if start is None else torch.cat([text.new_full((text.shape[0], 1), start), text], dim=1)


def sequences_ending_at(ids: torch.Tensor, ends: list[int], length: int, start: int | None) -> torch.Tensor:
    """(n, length) sequences whose text ends just before each of `ends` in the 1-D stream `ids`: `start` then
    length − 1 text tokens where `start` is not None (sequence_start's answer), else `length` text tokens. The
    prompt builders (zero-shot items, LoRA batches, conversion-cost prompts) use it, so their prompts are
    sequences like the windows, and a token at `ends[i]` is never part of prompt i."""
    width = length - (start is not None)  # text tokens per sequence
    return _as_sequences(torch.stack([ids[e - width : e] for e in ends]), start)


def bos_note(start: int | None) -> str:
    return "" if start is None else ", each window <bos> + text"


def eval_windows(source: str, tokenizer: Any, tokens: int = 8192, seq_len: int = 512) -> TokenWindows:
    """The first `tokens // seq_len` non-overlapping windows of the evaluation split (same for every model)."""
    check_lengths(seq_len, tokens)
    ids = token_ids(source, "eval", tokenizer)
    start = sequence_start(tokenizer)
    n, width = tokens // seq_len, seq_len - (start is not None)  # width: text tokens per window
    if ids.numel() < n * width:
        most = ids.numel() // width * seq_len
        fix = (f"lower --tokens to at most {most}" if most else
               f"lower --seq-len below {ids.numel()} or give a longer text")
        raise AttnslimError(
            f"the {source!r} evaluation split has {ids.numel()} tokens, fewer than the {n * seq_len} requested "
            f"({n} windows of {seq_len}); {fix}"
        )
    desc = f"{describe_split(source, 'eval')}, first {n}x{seq_len} tokens{bos_note(start)}"
    return TokenWindows(_as_sequences(ids[: n * width].view(n, width), start), source, "eval", desc)


def check_draw(source: str, tokenizer: Any, n: int, seq_len: int, where: str,
               steps: tuple[str, int] | None = None) -> None:
    """Refuse a draw of `n` calibration windows of `seq_len` tokens that the text cannot give, before any window
    (or its n start indices) is allocated. The bound: a part's windows may hold at most DRAW_FACTOR times the tokens
    of its calibration split. Windows start at random offsets with replacement, so a larger draw only repeats
    text: it costs time and memory (10^9 windows asked for 8 GB of start indices at once) and adds no information.
    A mixture gives window k to part k mod parts, so its bound is each part's, interleaved. `where` names the
    setting in the error ("calibration.windows=…"); `steps` = (name, windows per step) where the count is steps ×
    a batch, so that the fix names the steps ("heal.steps", 4)."""
    check_lengths(seq_len)
    if n < 1:
        raise AttnslimError(f"{where}: the number of windows must be >= 1, got {n}")
    parts = mixture(source)
    if SELF in parts and n > len(parts) * MAX_GENERATED:
        raise AttnslimError(f"{where} asks for {n:,} windows; the part 'self' samples each of its windows from the "
                            f"model, at most {MAX_GENERATED:,} of them (hours of generation beyond); ask for fewer")
    texts = [(j, p) for j, p in enumerate(parts) if p != SELF]  # sampled text has no split to exhaust
    if not texts:
        return
    most = {j: DRAW_FACTOR * token_ids(p, "calib", tokenizer).numel() // seq_len for j, p in texts}  # per part
    bound = min(j + len(parts) * m for j, m in most.items())  # the largest n no part of which exceeds its most
    if n > bound:
        sizes = ", ".join(f"{p!r} {token_ids(p, 'calib', tokenizer).numel():,}" for _, p in texts)
        fix = (f"ask for at most {bound:,} windows" if steps is None else
               f"give {steps[0]} <= {bound // steps[1]:,} ({steps[1]} windows a step)")
        raise AttnslimError(
            f"{where} asks for {n:,} windows of {seq_len} tokens, more than the calibration text can give: at most "
            f"{bound:,} windows of {seq_len} ({DRAW_FACTOR}x the tokens of the split{'s' if len(parts) > 1 else ''}: "
            f"{sizes}); {fix}, or shorter windows"
        )


def calib_windows(source: str, tokenizer: Any, n: int, seq_len: int, seed: int = 0,
                  where: str = "calibration windows", model: Any = None) -> TokenWindows:
    """`n` windows of `seq_len` tokens drawn from the calibration split with a seeded generator.

    A mixture "wiki+c4" takes windows round-robin from each part's calibration split (window k from part
    k mod parts), each part with its own generator seeded `seed`, so a part's windows do not depend on the others.
    The part "self" is sampled from `model` (data/generated.py): callers that calibrate a model pass it.
    """
    check_draw(source, tokenizer, n, seq_len, where)
    parts = mixture(source)
    if SELF in parts and model is None:
        raise AttnslimError(f"{where}: source 'self' samples the dense model, which this command does not load; "
                            "give a text source (wiki, c4, file:PATH)")
    counts = [len(range(j, n, len(parts))) for j in range(len(parts))]
    drawn = [generated_windows(model, tokenizer, c, seq_len, seed) if p == SELF
             else _draw(p, tokenizer, c, seq_len, seed) for p, c in zip(parts, counts, strict=True) if c]
    order = [drawn[k % len(parts)][k // len(parts)] for k in range(n)]
    desc = " + ".join(f"{describe_split(p, 'calib')}, {c}x{seq_len} tokens" for p, c in zip(parts, counts, strict=True)
                      if c)
    return TokenWindows(torch.stack(order), source, "calib",
                        f"{desc}{bos_note(sequence_start(tokenizer))}, seed {seed}")


def _draw(source: str, tokenizer: Any, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, seq_len) windows at seeded random starts in one source's calibration split (after the BOS, if any)."""
    ids = token_ids(source, "calib", tokenizer)
    start = sequence_start(tokenizer)
    width = seq_len - (start is not None)
    if ids.numel() < width + 1:
        raise AttnslimError(
            f"the {source!r} calibration split has {ids.numel()} tokens, too short for one window of {seq_len}; "
            "use a shorter seq_len or a longer text"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - width, (n,), generator=gen)
    return _as_sequences(torch.stack([ids[s : s + width] for s in starts.tolist()]), start)
