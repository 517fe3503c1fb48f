"""Training loops: LISA distillation (`attnslim.train.distill`), healing of any compressed model by logit
distillation (`attnslim.train.heal`), ATP's LoRA recovery (`attnslim.train.lora`).

The functions are not re-exported here so the package attributes keep naming the modules.
"""
