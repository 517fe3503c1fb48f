"""Loads an attnslim-compressed directory through `AutoModelForCausalLM(..., trust_remote_code=True)`.

transformers runs the copy of this file that sits in the directory. It hands over to the installed attnslim's
`attnslim.io.load`, which imports nothing from the directory."""

from transformers import PretrainedConfig, PreTrainedModel

# arguments about where to fetch files: the directory is already local, so they change nothing
_LOCATION_KWARGS = {"config", "cache_dir", "force_download", "proxies", "revision", "token", "local_files_only",
                    "subfolder", "code_revision", "_commit_hash", "trust_remote_code", "resume_download",
                    "use_auth_token", "adapter_kwargs", "_from_auto", "_from_pipeline"}


class AttnslimConfig(PretrainedConfig):
    """config.json of an attnslim directory; `attnslim_base_model_type` names the base family."""

    model_type = "attnslim"


class AttnslimForCausalLM(PreTrainedModel):
    config_class = AttnslimConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # type: ignore[override]
        import torch

        from attnslim.io import load

        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        dtype = torch.float32 if dtype in (None, "auto") else getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = kwargs.pop("device_map", None)
        unsupported = sorted(k for k in kwargs if k not in _LOCATION_KWARGS)
        if args or unsupported or not (device is None or isinstance(device, (str, torch.device))) or device == "auto":
            raise ValueError(f"attnslim directories load with dtype= and a single device_map= device only; "
                             f"unsupported: {unsupported or args or device!r}")
        model = load(pretrained_model_name_or_path, dtype)[0]
        return model if device is None else model.to(device)
