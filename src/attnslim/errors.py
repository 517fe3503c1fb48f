"""The library's one exception type: every message names the problem and the fix."""


class AttnslimError(ValueError):
    """Bad input or state; the message says what is wrong and what to do instead."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most `limit` characters ("" when it has none): the detail an
    AttnslimError quotes from the library error it wraps."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else ""
