"""Layer-by-layer calibration: capture decoder-layer-0 inputs once, then run one layer at a time.

Peak memory is the model plus the hidden states of the calibration windows (n·t·d floats) plus one
layer's working set; activations of the whole model are never held. With offloaded weights
(calib/residency.py) "the model" is one decoder layer and the embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from attnslim import _compat
from attnslim.adapters.base import Adapter
from attnslim.calib.hooks import capture_sites
from attnslim.calib.residency import InMemoryLayers, Residency
from attnslim.errors import AttnslimError


class _Captured(Exception):
    """Raised by the layer-0 hook to stop the forward pass once its inputs are captured."""


class _AttentionDone(Exception):
    """Raised after a layer's attention when nothing past it is wanted (`run_layer` without advancing)."""


ATTENTION_SITES = frozenset({"attn_in", "o_in", "attn_out", "resid_in"})  # sites at or before the attention output


class LayerRunner:
    """Holds the current inputs of one decoder layer for every calibration batch."""

    def __init__(self, model: nn.Module, adapter: Adapter, windows: torch.Tensor, batch_size: int = 4,
                 residency: Residency | None = None) -> None:
        self.model, self.adapter = model, adapter
        self.residency = residency or InMemoryLayers(model, adapter.decoder_layers(), next(model.parameters()).device)
        self.hidden: list[torch.Tensor] = []  # per batch (b, t, d)
        # per batch and layer type: mask, positions, rotary (cos, sin) as the model passes them
        self.kwargs: list[dict[str, dict[str, Any]]] = []
        self.layer_types = adapter.layer_types()
        self._capture(windows, batch_size)

    @torch.no_grad()
    def _capture(self, windows: torch.Tensor, batch_size: int) -> None:
        """Record layer 0's input, and the call kwargs of the first layer of each layer type (Gemma3 passes
        different masks and rotary tables to sliding and full layers); stop the forward after the last one."""
        layers = self.adapter.decoder_layers()
        device = self.residency.device
        first = {t: self.layer_types.index(t) for t in dict.fromkeys(self.layer_types)}
        stop_at = max(first.values())
        batch_kwargs: dict[str, dict[str, Any]] = {}

        def make_hook(layer_type: str, index: int) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                kw = dict(kwargs)
                hidden = args[0] if args else kw.pop("hidden_states")
                if index == 0:
                    self.hidden.append(hidden.detach())
                drop = ("past_key_values", "use_cache")
                batch_kwargs[layer_type] = {k: v for k, v in kw.items() if k not in drop}
                if index == stop_at:
                    raise _Captured

            return hook

        handles = [
            layers[i].register_forward_pre_hook(make_hook(t, i), with_kwargs=True) for t, i in first.items()
        ]
        try:
            with self.residency.streamed():  # after our hooks: the layer that stops the forward is never loaded
                for start in range(0, windows.shape[0], batch_size):
                    batch_kwargs = {}
                    try:
                        self.model(input_ids=windows[start : start + batch_size].to(device), use_cache=False)
                    except _Captured:
                        pass
                    self.kwargs.append(batch_kwargs)
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def run_layer(
        self, layer: int, sites: set[str] = frozenset(),  # type: ignore[assignment]
        callback: Callable[[str, torch.Tensor], None] | None = None, advance: bool = True,
    ) -> None:
        """Run decoder layer `layer` on every batch, feeding site activations to `callback`.

        With advance=True the stored hidden states become the layer's outputs (the next layer's inputs).
        Without advancing, when every requested site is at or before the attention's output, the layer stops
        after its attention (hooks on the attention, e.g. an output refit's, have run by then): the MLP's work
        would be thrown away.
        """
        module = self.adapter.decoder_layers()[layer]
        cb = callback or (lambda site, x: None)
        stop_early = not advance and set(sites) <= ATTENTION_SITES
        with capture_sites(self.adapter, layer, set(sites), cb):
            stop = self.adapter.attention(layer).register_forward_hook(_stop) if stop_early else None
            try:
                for b, (hidden, kwargs) in enumerate(zip(self.hidden, self.kwargs, strict=True)):
                    try:
                        out = module(hidden, **kwargs[self.layer_types[layer]])
                    except _AttentionDone:
                        continue
                    out = out[0] if isinstance(out, tuple) else out
                    if advance:
                        self.hidden[b] = out
            finally:
                if stop is not None:
                    stop.remove()

    def tokens(self) -> int:
        """Calibration tokens each layer sees (every window's positions)."""
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def run_all(self, layers: range, desc: str = "calibration") -> None:
        for i in tqdm(layers, desc=desc, leave=False):
            self.run_layer(i)


def _stop(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    """A forward hook registered after every other hook of the attention: its output is all that was wanted."""
    raise _AttentionDone


HEAD_SITE = "head_in"  # the output head's input: the final norm's output, what the logits are computed from


@torch.no_grad()
def head_inputs(model: nn.Module, head: nn.Module, windows: torch.Tensor, batch_size: int,
                callback: Callable[[str, torch.Tensor], None], residency: Residency) -> int:
    """Run the whole model on every calibration batch and hand the output head's input (b, t, d) to
    `callback(HEAD_SITE, x)`; each forward stops at the head (no logits computed). Returns the tokens seen.
    The model as it is: run after every layer step, the head is fitted on the compressed model's hidden states."""
    seen = 0

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal seen
        x = _compat.hidden_states_arg(args, kwargs).detach()  # (b, t, d)
        seen += x.shape[0] * x.shape[1]
        callback(HEAD_SITE, x)
        raise _Captured

    handle = head.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with residency.streamed():
            for start in range(0, windows.shape[0], batch_size):
                try:
                    model(input_ids=windows[start : start + batch_size].to(residency.device), use_cache=False)
                except _Captured:
                    continue
                raise AttnslimError("internal: the model's forward never called its output head")
    finally:
        handle.remove()
    return seen
