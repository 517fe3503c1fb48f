"""The names of attnslim's files on disk, in one place: what an output directory holds, how its weight shards are
named, and the config.json keys that mark it. Everything that writes or reads such a directory (io, models/load,
offload/, serving/, export/, outdir, verify, report/) takes the names from here.

Stdlib only and importing nothing of attnslim: the bottom of the import layers, and safe for the serving modules
that run inside vLLM's environment."""

from __future__ import annotations

import re

COMPRESSION_JSON = "compression.json"  # an attnslim output's record (io.save); also what --overwrite may replace
EXPORT_MARKER = "attnslim-export.json"  # ... or an attnslim export (export/), which has no compression.json
WEIGHTS = "model.safetensors"  # one weights file (io.save, the packaged models' cache)
INDEX = "model.safetensors.index.json"  # the weight map of a sharded checkpoint (an offloaded compression's too)
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
HF_ENTRY = "attnslim_hf.py"  # the trust_remote_code entry copied into each output (hf_entry/)
MODEL_TYPE = "attnslim"  # an output's config.json model_type: transformers alone refuses it, never loads it dense
BASE_TYPE_KEY = "attnslim_base_model_type"  # ... and the base family's model_type, kept under this key


def shard_name(k: int, n: int) -> str:
    """The k-th of n shards (1-based), named as Hugging Face names them (matches SHARD_NAME)."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"
