"""Named models from packaged weights, local HF directories, hub ids."""

from attnslim.models.load import load_model
from attnslim.models.zoo import ZOO

__all__ = ["ZOO", "load_model"]
