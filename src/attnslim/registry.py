"""Explicit name -> class registries. Also the allowlist of module classes a saved model may name."""

from __future__ import annotations

from typing import Any, TypeVar

from attnslim.errors import AttnslimError

T = TypeVar("T")

ADAPTERS: dict[str, type] = {}
METHODS: dict[str, type] = {}
MODULES: dict[str, type] = {}


def register_adapter(cls: type[T]) -> type[T]:
    for model_type in cls.model_types:  # type: ignore[attr-defined]
        ADAPTERS[model_type] = cls
    return cls


def register_method(name: str):
    def deco(cls: type[T]) -> type[T]:
        METHODS[name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return deco


def register_module(cls: type[T]) -> type[T]:
    MODULES[cls.__name__] = cls
    return cls


def lookup(table: dict[str, Any], kind: str, name: str) -> Any:
    """table[name], or an error listing the valid names. The tables fill as the packages that register into them
    are imported: use `attnslim.methods.lookup_method` and `attnslim.modules.MODULES`, which import them all."""
    if name not in table:
        raise AttnslimError(f"unknown {kind} {name!r}; valid choices: {', '.join(sorted(table)) or '(none)'}")
    return table[name]

