"""Validation shared by the training configs (`heal`, LISA's `train`): every bad value is an error that names
the recipe key, the value and the valid range."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from attnslim.errors import AttnslimError

T = TypeVar("T")


def check_ints(section: str, config: Any, lows: dict[str, int]) -> None:
    """Each named field is an int (not a bool) >= its lower bound."""
    for key, lo in lows.items():
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise AttnslimError(f"{section}.{key}={value!r} is invalid; valid: an int >= {lo}")


def check_ranges(section: str, config: Any, checks: dict[str, tuple[bool, str]]) -> None:
    """checks: field -> (whether its value is valid, the valid range in words)."""
    for key, (ok, valid) in checks.items():
        if not ok:
            raise AttnslimError(f"{section}.{key}={getattr(config, key)!r} is invalid; valid: {valid}")


def config_from_mapping(cls: type[T], section: str, d: Any) -> T:
    """Build the dataclass `cls` from a recipe section, refusing non-mappings and unknown keys."""
    if not isinstance(d, dict):
        raise AttnslimError(f"{section} must be a mapping of settings, got {type(d).__name__} {d!r}")
    valid = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(d) - valid):
        raise AttnslimError(f"{section} has unknown key(s) {unknown}; valid: {sorted(valid)}")
    return cls(**d)
