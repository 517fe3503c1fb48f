"""Named text sources (wiki, ptb, c4, tiny, file:PATH), fixed splits and token windows."""

from attnslim.data.sources import SOURCES, check_source, describe_split, load_text, mixture
from attnslim.data.windows import TokenWindows, calib_windows, check_lengths, eval_windows, token_ids

__all__ = [
    "SOURCES", "TokenWindows", "calib_windows", "check_lengths", "check_source", "describe_split", "eval_windows",
    "load_text", "mixture", "token_ids",
]
