"""Layer-local distillation targets: the teacher's attention inputs and outputs, matched layer by layer.

For each replaced attention layer i the student's module runs on the *teacher's* input of that layer (the
dense model's hidden states, with the rotary tables and mask the model passed) and is pulled towards the
teacher's attention output there:

    loss = mean_i ‖attn_i^student(X_i) − attn_i^teacher(X_i)‖² / ‖attn_i^teacher(X_i)‖²      (X_i: teacher input)

Every position of every layer is a target (b·t·d numbers per layer per batch), against one next-token target
per sequence for the last-position loss. The targets are causal attention outputs, so a non-causal student
(ATP's paper layer) gains nothing from future tokens by matching them. Layers train independently (teacher
inputs, not the student's own), as in layer-wise compression methods, so errors that compound through the
converted layers are not trained against: measured with ATP's paper layer on every layer, longer layer-match
training ends lower than shorter, while with only a few layers converted it recovers most of the accuracy
(benchmarks/atp.py; the archived section "ATP: recovery of the paper's layer on all 30 layers ...", rows
"layer-match").
"""

from __future__ import annotations

from typing import Any

import torch

from attnslim.adapters import get_adapter
from attnslim.train.teacher import teacher_attention


def layer_match_loss(student: Any, teacher: Any, layers: list[int], ids: torch.Tensor) -> torch.Tensor:
    """Mean relative squared error of the student's attention outputs at `layers` on the teacher's inputs.

    student: the HF model whose attention modules train (under peft: `peft_model.get_base_model()`, whose
    linears carry the LoRA wrappers); ids (b, t) token ids.
    """
    targets: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
    with torch.no_grad(), teacher_attention(teacher, layers, lambda i, call, y: targets.__setitem__(i, (call, y))):
        teacher(input_ids=ids, use_cache=False)
    adapter = get_adapter(student)
    losses = []
    for i in layers:
        call, y = targets[i]
        out = adapter.attention(i)(**call)
        out = out[0] if isinstance(out, tuple) else out  # (b, t, d)
        losses.append(((out.float() - y.float()) ** 2).sum() / (y.float() ** 2).sum().clamp_min(1e-12))
    return torch.stack(losses).mean()
