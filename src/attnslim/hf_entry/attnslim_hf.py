"""Loads an attnslim-compressed directory through `AutoModelForCausalLM(..., trust_remote_code=True)`."""

from transformers import PreTrainedModel


class AttnslimForCausalLM(PreTrainedModel):
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # type: ignore[override]
        from attnslim.io import load

        return load(pretrained_model_name_or_path)[0]
