"""Reading the original (teacher) model's attention layers during a forward, for distillation losses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim.adapters import get_adapter


class _TeacherDone(Exception):
    """Raised after the deepest needed layer: the rest of the teacher (and its LM head) is not run."""


@contextmanager
def teacher_attention(
    teacher: Any, layers: list[int], collect: Callable[[int, dict[str, Any], torch.Tensor], None]
) -> Iterator[None]:
    """While a forward of `teacher` runs inside the block, call collect(i, call, out) at every attention layer
    i in `layers` — call: the module's keyword arguments with `hidden_states` (cache arguments dropped, so
    the call can be replayed on another module); out: its output (b, t, d), detached — and stop the forward
    after the deepest layer (the stopping exception is swallowed on exit)."""
    adapter = get_adapter(teacher)
    handles = []

    def hook(i: int) -> Any:
        def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            call = {k: v for k, v in kwargs.items() if k not in _compat.CACHE_KWARGS}
            call["hidden_states"] = _compat.hidden_states_arg(args, kwargs)
            collect(i, call, (out[0] if isinstance(out, tuple) else out).detach())
            if i == max(layers):
                raise _TeacherDone

        return capture

    try:
        for i in layers:
            handles.append(adapter.attention(i).register_forward_hook(hook(i), with_kwargs=True))
        yield
    except _TeacherDone:
        pass
    finally:
        for h in handles:
            h.remove()
