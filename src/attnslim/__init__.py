"""attnslim: cheaper attention for pretrained Hugging Face LLMs."""

__version__ = "0.1.0"
