"""ATP's costs as reported and as run: FLOP counts over the principal keys, and no L×L tensor in the paper layer."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnslim.adapters import get_adapter
from attnslim.bench.flops import flops_per_token
from conftest import tiny_llama
from helpers import convert_atp


def test_flops_count_the_entries_attended_not_the_context():
    dense = flops_per_token(tiny_llama(), 1024)["attention_core"]  # 4 layers × 4·1024·H·hd
    serving = convert_atp(tiny_llama(), rank=0.25, form="serving", window=32)
    assert flops_per_token(serving, 1024)["attention_core"] == pytest.approx(dense * (256 + 32) / 1024)
    paper = convert_atp(tiny_llama(), rank=64, form="paper")  # fixed r: the per-token cost does not grow with L
    # scores + values over r keys; UᵀX; K′ = UᵀRoPE(K); U·(X′W) for q (lowrank) and k (cheap): 2 FLOPs per MAC
    per_layer = 4 * 64 * 4 * 16 + 2 * 64 * (64 + 2 * 16) + 2 * 64 * (4 * 16 + 2 * 16)
    for context in (256, 1024, 4096):
        assert flops_per_token(paper, context)["attention_core"] == 4 * per_layer
    assert flops_per_token(tiny_llama(), 4096)["attention_core"] == 4 * dense


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("mask", [False, True])
def test_the_paper_layer_builds_no_length_by_length_tensor(mask):
    """Linear memory in L (notes property 8), with and without a padding mask; L = 256 > d = 64, so U (L × r)
    is not square."""
    model = convert_atp(tiny_llama(), rank=0.25, form="paper")
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    layer = get_adapter(model).attention(1)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        pos = torch.arange(256)[None]
        cos_sin = model.model.rotary_emb(hidden, pos)
        attention_mask = torch.ones(1, 1, 1, 256, dtype=torch.bool) if mask else None
        with _Shapes() as recorder:
            layer(hidden, position_embeddings=cos_sin, attention_mask=attention_mask)
    assert recorder.shapes and not [s for s in recorder.shapes if s[-2:] == (256, 256)]
