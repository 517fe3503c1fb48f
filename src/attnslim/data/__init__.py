"""Named text sources (wiki, ptb, c4, tiny, file:PATH), fixed splits and token windows."""

from attnslim.data.sources import SOURCES, check_source, describe_split, load_text, mixture
from attnslim.data.windows import (
    TokenWindows,
    bos_note,
    calib_windows,
    check_draw,
    check_lengths,
    eval_windows,
    sequence_start,
    sequences_ending_at,
    token_ids,
)

__all__ = [
    "SOURCES", "TokenWindows", "bos_note", "calib_windows", "check_draw", "check_lengths", "check_source",
    "describe_split",
    "eval_windows", "load_text", "mixture", "sequence_start", "sequences_ending_at", "token_ids",
]
