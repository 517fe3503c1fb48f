"""LISA (seed 002) testable properties of shared/methods/lisa.md §7 not covered by test_lisa.py:
the direct-sharing identity along a chain (#2), the LLaMA-shaped parameter counts (#8), global head matching
recovering heads permuted between layers (#13)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnslim.adapters import get_adapter
from attnslim.methods.lisa import Ds, Lisa
from attnslim.modules.shared import DonorAttention, SharedAttention
from conftest import tiny_llama
from helpers import ByteTokenizer, install_sharing

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _weights(modules) -> int:
    """Trainable weights, biases excluded (the note's count)."""
    return sum(p.numel() for m in modules for p in m.trainable() if p.dim() > 1)


# --- #2: DS identity -------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_direct_sharing_chain_reuses_layer0_scores_bit_for_bit():
    """Notes §7 #2: a DS chain 1..3 gives every layer exactly layer 0's scores, hence layer 0's probabilities."""
    original = tiny_llama(attn_implementation="eager")
    probs = original(input_ids=IDS, output_attentions=True).attentions  # per layer (b, h, l, l)
    assert not torch.allclose(probs[1], probs[0], atol=1e-3)  # without sharing, layers attend differently
    model = tiny_llama()
    adapter = install_sharing(model, Ds(), [1, 2, 3])
    donor, receivers = adapter.attention(0), {i: adapter.attention(i) for i in (1, 2, 3)}
    assert isinstance(donor, DonorAttention)
    assert all(isinstance(m, SharedAttention) and m.kind() == "ds" and not m.trainable() for m in receivers.values())
    seen: dict[int, torch.Tensor] = {}
    put = donor.export.put
    donor.export.put = lambda s: (seen.__setitem__(0, s), put(s))[1]
    for m in receivers.values():
        m.score_sink = lambda i, s: seen.__setitem__(i, s)
    io = {}
    hook = receivers[2].register_forward_hook(
        lambda mod, args, kwargs, out: io.update(x=kwargs["hidden_states"], out=out[0]), with_kwargs=True)
    model(input_ids=IDS)
    hook.remove()
    assert sorted(seen) == [0, 1, 2, 3]
    for i in (1, 2, 3):
        assert torch.equal(seen[i], seen[0])  # bit-for-bit, along the whole chain
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    p0 = torch.softmax(seen[0].masked_fill(~causal, float("-inf")), dim=-1)
    assert torch.allclose(p0, probs[0], atol=1e-6)  # the shared scores are the original layer 0's
    # layer 2 = softmax(A_0) with its own V and W_o (HF's original layer-2 weights)
    attn2 = original.model.layers[2].self_attn
    v = attn2.v_proj(io["x"]).view(2, 16, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)  # (b, h, l, d)
    ref = attn2.o_proj((probs[0] @ v).transpose(1, 2).reshape(2, 16, 64))
    assert torch.allclose(io["out"], ref, atol=1e-5)


# --- #8: parameter count ---------------------------------------------------------------------------------------------

def _meta_llama(layers: int, kv_heads: int, vocab: int) -> LlamaForCausalLM:
    with torch.device("meta"):  # shapes only: nothing is allocated
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=4096, intermediate_size=14336 if kv_heads == 8 else 11008, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=kv_heads, head_dim=128, vocab_size=vocab,
        ))


def test_lisa17_parameter_count_on_llama3_8b_shapes():
    """Notes §7 #8: "For a LLaMA3-8B-shaped config, LISA(17) adds exactly 56,123,392 weights (excluding biases)"."""
    model = _meta_llama(32, 8, 128256)
    before = sum(p.numel() for p in model.parameters())
    method, adapter = Lisa(select="preset", percent=53), get_adapter(model)
    plan = method.plan(adapter, list(range(32)), {})
    assert sorted(plan.layers) == [4, 5, *range(16, 31)]  # Table 4, paper layers 5, 6, 17–31
    with torch.device("meta"):
        for i, entry in plan.layers.items():
            method.skeleton(adapter, i, entry)
    assert all(p.is_meta for p in model.parameters())
    shared = [m for m in (adapter.attention(i) for i in range(32)) if isinstance(m, SharedAttention)]
    assert len(shared) == 17
    assert _weights(shared) == 56_123_392  # the note's number (3,301,376 per layer)
    assert round(100 * _weights(shared) / before, 1) == 0.7  # the paper's "56 million … 0.7%" of LLaMA3-8B
    biases = sum(p.numel() for m in shared for p in m.trainable() if p.dim() == 1)
    dropped = 17 * 4096 * (32 + 8) * 128  # W_q and W_k of the 17 layers (notes §3.1: dropped without NF)
    assert before - sum(p.numel() for p in model.parameters()) == dropped - _weights(shared) - biases


def test_lisa_parameter_count_per_layer_on_llama2_7b_shapes():
    """Notes §7 #8: "The LLaMA2-7B shape gives 5,267,456 per layer" (MHA, g = h = 32)."""
    model = _meta_llama(2, 32, 32000)
    spec = get_adapter(model).attention_spec(1)
    with torch.device("meta"):
        module = SharedAttention(spec, Lisa().sharing(spec.head_dim, spec.n_heads))
    assert module.cfg.rank == 20 and module.cfg.align_hidden == 256  # r = 128/6.4, aligner 2h -> 256 -> h
    assert _weights([module]) == 5_267_456


# --- #13: global head matching finds heads that moved between layers ------------------------------------------------

def test_global_head_matching_recovers_heads_permuted_between_layers():
    """Notes §7 #13, constructed so it can fail: layer 1 leaves the residual stream unchanged (o_proj and down_proj
    zero), so layer 2 sees layer 1's input; layer 2's q/k are layer 1's with the heads permuted (KV heads swapped,
    query heads moved to the other group by q_perm, which is not its own inverse, so a matching read in the wrong
    direction (layer 1 -> layer 2) fails). Its attention maps are then layer 1's,
    permuted: global matching must recover the permutation with zero divergence, where direct sharing (head a to
    head a) diverges; the other pairs keep their random heads."""
    from attnslim.analysis import similarity_report

    model = tiny_llama()
    one, two = model.model.layers[1], model.model.layers[2]
    d = 16  # head_dim: 4 query heads in 2 KV groups
    q_perm = [2, 3, 1, 0]  # q head a of layer 2 is q head q_perm[a] of layer 1; its inverse is [3, 2, 0, 1]
    with torch.no_grad():
        one.self_attn.o_proj.weight.zero_()
        one.mlp.down_proj.weight.zero_()
        two.input_layernorm.weight.copy_(one.input_layernorm.weight)
        q = one.self_attn.q_proj.weight.view(4, d, -1)
        two.self_attn.q_proj.weight.copy_(q[q_perm].reshape(4 * d, -1))
        k = one.self_attn.k_proj.weight.view(2, d, -1)
        two.self_attn.k_proj.weight.copy_(k[[1, 0]].reshape(2 * d, -1))
    hm = similarity_report(model, ByteTokenizer(), "tiny", n=3, seq_len=16, progress=False)["head_matching"]
    assert list(hm["global_match"][1]) == q_perm  # pair (1, 2): head a of layer 2 -> head of layer 1
    assert hm["global"][1] < 1e-9 and hm["direct"][1] > 1e-5
    # unrelated random layers (near-uniform maps) keep a divergence the exact pair does not have
    assert all(g > 1e-5 for i, g in enumerate(hm["global"]) if i != 1)
