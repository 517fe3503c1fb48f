"""Exports of attnslim outputs into formats that other engines load without attnslim.

deepseek.py: an all-MLA output as a stock DeepseekV3ForCausalLM checkpoint (transformers, vLLM).
deci.py: an output with dropped attention layers as a DeciLM (nemotron-nas) checkpoint that vLLM serves natively.
"""

from attnslim.export.deci import export_deci
from attnslim.export.deepseek import ExportOptions, export_deepseek

__all__ = ["ExportOptions", "export_deci", "export_deepseek"]
