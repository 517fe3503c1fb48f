"""Type checks of method arguments against their dataclass annotations, before `__post_init__` compares them.

YAML and `--set` hand over whatever the user wrote: `ratio=abc` would reach `ratio < 0` as a str (a TypeError
traceback), `ratio=true` would count as 1.0 and `linears=qkvo` as the letters q, k, v, o. Each is refused here with
the key, the value and the expected type."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Union

from attnslim.errors import AttnslimError


def check_arg_types(method: str, cls: type, args: Mapping[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    for key, value in args.items():
        hint = hints.get(key)
        if hint is not None and not _matches(value, hint):
            raise AttnslimError(f"method {method!r}: {key}={value!r} is a {type(value).__name__}; expected "
                                f"{_describe(hint)}")


def _matches(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (tuple, list) or hint in (tuple, list):
        return isinstance(value, (list, tuple))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True  # an annotation this check does not model: __post_init__ validates it


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return "a list, e.g. [q, k, v]"
    if origin is dict or hint is dict:
        return "a mapping, e.g. {steps: 10}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))
