"""Which serving route runs which layer kinds of which model families: one list for the planner (`--engine vllm`
plans only what one route serves; every plan's report names its routes), `attnslim serve` and the exporters. Only
stdlib (a leaf: code that runs inside vLLM's environment imports it too).

    transformers  `attnslim.load`: every kind, every family
    plugin        attnslim's vLLM model (serving/vllm_model.py: vLLM's own Llama with linearised and dropped
                  layers), through `attnslim serve DIR`: kept, `nbl` and `drop` layers of a Llama-family or Qwen2
                  output (Qwen2's q/k/v biases are vLLM's Llama `qkv_bias`: serving/vllm_config.py)
    deci          `attnslim export --to deci`: stock vLLM's DeciLM (nemotron-nas `no_op` attention), no plugin:
                  kept and dropped layers of a Llama-family output
    deepseek-v3   `attnslim export --to deepseek-v3`: stock vLLM's DeepSeek model, every layer MLA in DeepSeek's
                  layout at a width vLLM's kernels take (mla_widths.py)

No vLLM model holds MLA layers beside multi-head or KV-free ones yet (docs/serving.md, "Mixed models"), so a plan
meant for vLLM holds the kinds of one route.
"""

from __future__ import annotations

from collections.abc import Sequence

PLUGIN_BASES = ("llama", "qwen2")  # the families attnslim's vLLM model builds (vLLM's Llama layers)
DECI_BASES = ("llama",)  # vLLM's DeciLM layers are Llama's (no sliding window, Llama's biases)
DEEPSEEK_BASES = ("llama", "mistral", "qwen2")  # qwen2: its q/k/v biases folded by mla `biases: fold`
# the vLLM routes a planner chooses among, with the layer kinds each serves
VLLM_ROUTES: dict[str, tuple[str, ...]] = {"plugin": ("keep", "nbl", "drop"), "deepseek-v3": ("mla",)}
ROUTE_BASES = {"plugin": PLUGIN_BASES, "deci": DECI_BASES, "deepseek-v3": DEEPSEEK_BASES}
HOW = {"transformers": "attnslim.load (transformers)",
       "plugin": "vLLM through attnslim's plugin: attnslim serve DIR",
       "deci": "stock vLLM without a plugin: attnslim export DIR --to deci",
       "deepseek-v3": "stock vLLM's DeepSeek model: attnslim export DIR --to deepseek-v3 --kv-lora-rank auto"}


def routes(layers: Sequence[str], model_type: str, mla_served: bool) -> list[str]:
    """The routes that serve a model whose layer i is of kind `layers[i]` (keep, mla, nbl, drop, ds, ...) on a
    `model_type` base; `mla_served`: its MLA layers are in DeepSeek's layout at a width vLLM takes (as `--engine
    vllm` plans them). DeciLM's export keeps layer 0's attention (export/deci_check.py)."""
    kinds = set(layers)
    out = ["transformers"]
    if kinds <= {"keep", "nbl", "drop"} and model_type in PLUGIN_BASES:
        out.append("plugin")
    if kinds <= {"keep", "drop"} and "drop" in kinds and layers[0] != "drop" and model_type in DECI_BASES:
        out.append("deci")
    if kinds == {"mla"} and mla_served and model_type in DEEPSEEK_BASES:
        out.append("deepseek-v3")
    return out
