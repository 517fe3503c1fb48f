"""Training loops used by methods that learn new parameters after conversion (LISA distillation).

`attnslim.train.distill` is the module (DistillConfig, distill); the function is not re-exported here so
the package attribute keeps naming the module.
"""
