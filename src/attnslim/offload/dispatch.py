"""Running a model whose decoder layers stay on disk (`eval`, `generate`, `bench` with `--offload`).

accelerate does the work: every decoder layer gets an `AlignDevicesHook` that reads its weights from the
safetensors files (memory-mapped, never copied to an offload folder) when the layer runs and drops them after,
with `place_submodules=True` so the whole layer is resident during its forward. One hook per decoder layer rather
than accelerate's per-leaf hooks (`dispatch_model`), because replacement attention modules read their children's
weights directly (absorbed projections, latent factors) outside the children's own forwards. Embeddings, the final
norm, the LM head and every buffer are loaded into memory (they are needed at every step and are small).
Replacement modules that cache weights derived from their parameters drop them after each forward
(`release_derived`), so resident memory does not grow with depth.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from attnslim.errors import AttnslimError
from attnslim.offload.source import WeightSource
from attnslim.offload.store import release_derived


def dispatch_layers(model: nn.Module, layers: nn.ModuleList, directory: Path, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Fill `model` (parameters on the meta device) from `directory`: everything outside the decoder layers
    `layers` and every buffer in memory on `device`, each layer's parameters read from disk by an accelerate hook
    while it runs."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, set_module_tensor_to_device

    prefix = next(name for name, m in model.named_modules() if m is layers) + "."
    source = WeightSource(directory)  # names a missing or truncated shard before anything is read
    index = {name: {"safetensors_file": str(directory / shard), "weight_name": name,
                    "dtype": str(dtype).removeprefix("torch.")} for name, shard in source.where.items()}
    in_layers = tuple(f"{prefix}{i}." for i in range(len(layers)))
    buffers = {name for name, _ in model.named_buffers()}
    getattr(model, "tie_weights", lambda: None)()  # tied names then share one meta parameter (saved once)
    for group in _tied_names(model, buffers):
        if group[0].startswith(in_layers) and group[0] not in buffers:
            continue  # read by the layer's hook
        stored = source.first_of(group)
        value = source.read([stored], device, None)[stored]  # integer buffers keep their dtype
        set_module_tensor_to_device(model, group[0], device, value=value.to(dtype) if value.is_floating_point()
                                    else value)
        tensor = model.get_parameter(group[0]) if group[0] not in buffers else None
        for alias in group[1:]:  # tied names share the one tensor, as saved (stored once)
            owner, _, leaf = alias.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = tensor
    weights = OffloadedWeightsLoader(index=index, device=str(device))
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param.device.type != "meta":
                raise AttnslimError(f"layer {i} parameter {name} was materialised before dispatch")
            source.first_of([f"{prefix}{i}.{name}"])  # an error naming the tensor when no file holds it
        hook = AlignDevicesHook(execution_device=device, offload=True, io_same_device=True,
                                weights_map=PrefixedDataset(weights, f"{prefix}{i}."), offload_buffers=False,
                                place_submodules=True)
        add_hook_to_module(layer, hook)
        layer.register_forward_hook(lambda module, args, out: release_derived(module))


def _tied_names(model: nn.Module, buffers: set[str]) -> list[list[str]]:
    """Every parameter and persistent buffer name, tied parameters grouped (one tensor, several names)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    state = set(model.state_dict(keep_vars=True))
    return [*groups.values(), *([b] for b in sorted(buffers) if b in state)]

