"""Hooks as context managers: they exist only inside `with` blocks and are always removed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from attnslim import _compat
from attnslim.adapters.base import Adapter
from attnslim.errors import AttnslimError

# Sites a method may request statistics at, for decoder layer i:
#   attn_in : input of q/k/v (after the pre-attention norm)      o_in   : input of the output projection
#   mlp_in  : input of gate/up                                   down_in: input of the down projection
#   resid_in: residual stream entering the decoder layer         attn_out: attention sub-block output
SITES = ("attn_in", "o_in", "mlp_in", "down_in", "resid_in", "attn_out")
# the site whose activations are each decoder linear's input
SITE_OF = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "o_in", "gate": "mlp_in", "up": "mlp_in",
           "down": "down_in"}

Callback = Callable[[str, torch.Tensor], None]


def _pre_hook(site: str, cb: Callback) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = _compat.hidden_states_arg(args, kwargs)
        cb(site, x.detach())

    return hook


def _post_hook(site: str, cb: Callback) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        y = out[0] if isinstance(out, tuple) else out
        cb(site, y.detach())

    return hook


def site_module(adapter: Adapter, layer: int, site: str) -> tuple[nn.Module, bool]:
    """(module, is_pre_hook) for a site; the adapter knows where each module lives."""
    if site == "attn_in":
        return adapter.attention(layer), True
    if site == "o_in":
        return adapter.linear(layer, "o"), True
    if site == "mlp_in":
        return adapter.linear(layer, "up"), True
    if site == "down_in":
        return adapter.linear(layer, "down"), True
    if site == "resid_in":
        return adapter.decoder_layers()[layer], True
    if site == "attn_out":
        return adapter.attention(layer), False
    raise AttnslimError(f"unknown statistics site {site!r}; valid: {', '.join(SITES)}")


@contextmanager
def capture_sites(adapter: Adapter, layer: int, sites: set[str], callback: Callback) -> Iterator[None]:
    """Call `callback(site, tensor)` with each requested site's activation while the block runs."""
    handles = []
    try:
        for site in sorted(sites):
            module, pre = site_module(adapter, layer, site)
            if pre:
                handles.append(module.register_forward_pre_hook(_pre_hook(site, callback), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(_post_hook(site, callback), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


PairSink = Callable[[tuple[Any, ...], dict[str, Any], torch.Tensor], None]


@contextmanager
def beside_original(new: nn.Module, original: nn.Module, sink: PairSink) -> Iterator[None]:
    """While the block runs, every call of `new` (a converted attention) also runs `original` on the same
    arguments (hidden states, mask, positions), and hands (args, kwargs, original's output (b, t, d)) to `sink`:
    the pairs a post-conversion fit matches the new module against (pipeline/refit.py, pipeline/local_fit.py)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        want = original(*args, **kwargs)
        sink(args, kwargs, (want[0] if isinstance(want, tuple) else want).detach())

    handle = new.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
