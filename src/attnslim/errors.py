"""The library's one exception type: every message names the problem and the fix."""


class AttnslimError(ValueError):
    """Bad input or state; the message says what is wrong and what to do instead."""
