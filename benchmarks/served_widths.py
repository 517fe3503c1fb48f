"""What each MLA cache width vLLM serves costs, as a fraction of the dense KV cache, for the packaged models and
for the shapes of Llama-3-8B and Qwen2.5-7B: computed from configs (models built on the meta device, no weights),
read through attnslim's adapters, with the widths from attnslim/mla_widths.py.

Per layer and token, the dense cache holds 2 · kv_heads · head_dim values; a DeepSeek-V3 export holds
kv_lora_rank + qk_rope_head_dim, where the export's rotary key is the model's own rotary width (export/deepseek.py),
or 64 when mla kept pairs only at frequencies a 64-dim key has (`rope_stride`, `rope_fastest`); `served_by_export`
says whether and how `attnslim export --kv-lora-rank auto` reaches a served width (kv_lora_rank 256 or 512 + 64).

    .venv/bin/python benchmarks/served_widths.py
writes benchmarks/results/served-widths.json and prints the Markdown table of docs/serving.md ("Served widths").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS  # noqa: E402

from attnslim.adapters import get_adapter  # noqa: E402
from attnslim.engines import DEEPSEEK_BASES  # noqa: E402
from attnslim.mla_widths import VLLM_CPU_LORA_RANK, VLLM_LORA_RANKS, VLLM_ROPE  # noqa: E402
from attnslim.models.load import checkpoint_directory, load_skeleton  # noqa: E402

PACKAGED = ("smollm2-135m", "gemma3-270m", "qwen2.5-1.5b")
# shapes from the models' published config.json (meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B): no weights needed
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3-8B (shape)": ("llama", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                     "rope_theta": 500000.0, "vocab_size": 128256}),
    "Qwen2.5-7B (shape)": ("qwen2", {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                     "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
                                     "rope_theta": 1000000.0, "vocab_size": 152064}),
}


def meta_model(model_type: str, fields: dict[str, Any]) -> Any:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))


def _reach(rope: int, model_type: str, biased: bool) -> str:
    """How `attnslim export --kv-lora-rank auto` reaches a served width for this model, or why it does not.
    `biased`: q/k/v biases, which vLLM's DeepSeek model has no place for (mla `biases: fold`, docs/serving.md)."""
    why = [f"{model_type} is not exported"] if model_type not in DEEPSEEK_BASES else []
    if rope % VLLM_ROPE or rope < VLLM_ROPE:
        why.append(f"rotary key {rope} is no multiple of {VLLM_ROPE}")
    if why:
        return "no: " + ", ".join(why)
    needs = (["`biases: fold`"] if biased else []) + (
        [] if rope == VLLM_ROPE else [f"`rope_fastest: {VLLM_ROPE // 2}` or `rope_stride: {rope // VLLM_ROPE}`"])
    return "with mla " + " and ".join(needs) if needs else "yes"


def row(name: str, model: Any) -> dict[str, Any]:
    adapter = get_adapter(model)
    heads = adapter.attention_heads(0)
    rotary = adapter.rotary_embedding()
    # the rotary width (the export's qk_rope_head_dim): Gemma-3's module keeps one table per layer type
    tables = [getattr(rotary, n, None) for n in ("inv_freq", "full_attention_inv_freq")]
    rope = next(2 * int(t.numel()) for t in tables if t is not None)
    dense = 2 * heads.n_kv_heads * heads.head_dim
    model_type = str(adapter.config.model_type)
    spec = adapter.attention_spec(0)
    biased = any(spec.bias(n) is not None for n in ("q", "k", "v"))
    return {"model": name, "model_type": model_type, "attention_biases": biased, "layers": adapter.num_layers(),
            "kv_heads": heads.n_kv_heads,
            "head_dim": heads.head_dim, "dense_kv_per_token_and_layer": dense, "export_rotary_dims": rope,
            "widths": {str(r + VLLM_ROPE): {"kv_lora_rank": r, "kv_fraction": (r + VLLM_ROPE) / dense,
                                            "vllm_cpu": r == VLLM_CPU_LORA_RANK} for r in VLLM_LORA_RANKS},
            "served_by_export": _reach(rope, model_type, biased)}


def table(rows: list[dict[str, Any]]) -> str:
    widths = [str(r + VLLM_ROPE) for r in VLLM_LORA_RANKS]
    head = ("| model | KV heads × head_dim | dense KV / token / layer | "
            + " | ".join(f"width {w} (rank {int(w) - VLLM_ROPE})" for w in widths)
            + " | model's rotary key | `export --kv-lora-rank auto` |")
    lines = [head, "|" + "---|" * (5 + len(widths))]
    for r in rows:
        cells = " | ".join(f"{r['widths'][w]['kv_fraction']:.3f}×" for w in widths)
        lines.append(f"| {r['model']} | {r['kv_heads']} × {r['head_dim']} | {r['dense_kv_per_token_and_layer']} | "
                     f"{cells} | {r['export_rotary_dims']} | {r['served_by_export']} |")
    return "\n".join(lines)


def main() -> None:
    rows = [row(name, load_skeleton(checkpoint_directory(name))[0]) for name in PACKAGED]
    rows += [row(name, meta_model(model_type, fields)) for name, (model_type, fields) in SHAPES.items()]
    (RESULTS / "served-widths.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {RESULTS / 'served-widths.json'}")


if __name__ == "__main__":
    main()
