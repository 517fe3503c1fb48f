"""Reliability round 3, serving (issue 43; cases of shared/reviews/reliability.md): who may use the server (v08, v09,
v16), the options vLLM would take unchecked (v22-v24), the serve plan reader on damaged plans (v27-v31) and
`serve nosuch` (v04). No vLLM needed: a fake serving venv whose bin/python prints the argv and VLLM_* environment it
was exec'd with stands in for .venv-vllm, as in the review."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnslim.cli import main as cli_main
from attnslim.errors import AttnslimError
from attnslim.serving import launch
from attnslim.serving.plan import NBL_INPUTS, layer_kinds
from conftest import tiny_llama
from helpers import ByteTokenizer, SavingTokenizer, one_step

SRC = Path(launch.__file__).resolve().parents[2]  # the attnslim under test, for `python -m attnslim`


@pytest.fixture
def fake_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A serving venv whose python prints {"argv": [...], "env": {VLLM_*}} as JSON, and no VLLM_API_KEY around."""
    venv = tmp_path / "fakevenv"
    (venv / "lib" / "python3.12" / "site-packages" / "vllm").mkdir(parents=True)
    (venv / "lib" / "python3.12" / "site-packages" / "vllm" / "__init__.py").write_text("")
    (venv / "bin").mkdir()
    python = venv / "bin" / "python"
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import json, os, sys
        print(json.dumps({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}))
        """))
    python.chmod(0o755)
    monkeypatch.setenv(launch.VENV_ENV, str(venv))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return venv


@pytest.fixture(scope="module")
def drop_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from attnslim.api import compress
    from attnslim.io import save

    model = tiny_llama()
    report = compress(model, ByteTokenizer(), one_step("drop", {"count": 2, "select": "similarity"}), progress=False)
    return save(model, SavingTokenizer(), tmp_path_factory.mktemp("serve") / "drop", report.to_json())


@pytest.fixture
def served(drop_output: Path, tmp_path: Path) -> Path:
    """A fresh copy of a drop output (4 layers, 2 dropped) that a test may damage."""
    return Path(shutil.copytree(drop_output, tmp_path / "drop"))


class Exec:
    """What serve() would have exec'd: os.execve replaced for in-process runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []
        monkeypatch.setattr(os, "execve", lambda path, argv, env: self.calls.append((list(argv), dict(env))))

    @property
    def argv(self) -> list[str]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][0]

    @property
    def env(self) -> dict[str, str]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][1]


@pytest.fixture
def execs(monkeypatch: pytest.MonkeyPatch) -> Exec:
    return Exec(monkeypatch)


def _refused(execs: Exec, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of `attnslim serve ARGV`, which must fail (rc 2) before starting anything."""
    assert cli_main(["serve", *argv]) == 2
    assert execs.calls == []
    return capsys.readouterr().err


def _serve_process(args: list[str], env: dict[str, str], memory: int | None = None) -> tuple[int, str, str]:
    """`attnslim serve ARGS` in its own process (the real execve into the fake venv); `memory` caps its address
    space, so a read of /dev/zero fails fast instead of filling the machine."""
    def limit() -> None:
        import resource

        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    full = {**os.environ, **env, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "attnslim", "serve", *args], env=full, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit)
    return proc.returncode, proc.stdout, proc.stderr


def _port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _edit_plan(directory: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = directory / "compression.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


def _rename_layer(directory: Path, key: str) -> None:
    def edit(info: dict) -> None:  # type: ignore[type-arg]
        layers = info["steps"][0]["plan"]["layers"]
        layers[key] = layers.pop(sorted(layers)[0])

    _edit_plan(directory, edit)


# --- F4: who may use the server -------------------------------------------------------------------------------


def test_v09_env_api_key_kept(fake_venv: Path, served: Path) -> None:
    """VLLM_API_KEY in the environment reaches vLLM (it was popped: a server with no key and no message)."""
    rc, out, err = _serve_process([str(served), "--port", _port()], {"VLLM_API_KEY": "envsecret"})
    assert rc == 0, err
    started = json.loads(out.splitlines()[-1])
    assert started["env"]["VLLM_API_KEY"] == "envsecret" and "envsecret" not in " ".join(started["argv"])
    assert "clients must send the API key from VLLM_API_KEY" in out


def test_v09_env_api_key_empty_or_doubled_refused(fake_venv: Path, served: Path, execs: Exec,
                                                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                                  ) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert "the API key from VLLM_API_KEY is empty" in _refused(execs, capsys, str(served))
    monkeypatch.setenv("VLLM_API_KEY", "envsecret")
    assert "given 2 ways (--api-key, VLLM_API_KEY)" in _refused(execs, capsys, str(served), "--api-key", "other")
    err = _refused(execs, capsys, str(served), "--no-api-key")
    assert "--no-api-key contradicts the key from VLLM_API_KEY" in err


def test_v16_empty_host_refused(fake_venv: Path, served: Path, execs: Exec, capsys: pytest.CaptureFixture[str]
                                ) -> None:
    """--host '' (an unset $HOST) bound every interface; now refused before anything starts."""
    for host in ("", "  "):
        assert "--host is empty" in _refused(execs, capsys, str(served), "--host", host)


def test_v16_open_host_needs_a_key_or_no_api_key(fake_venv: Path, served: Path, execs: Exec,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A host other than loopback without a key is refused; --no-api-key serves it on purpose, with a warning."""
    port = _port()
    err = _refused(execs, capsys, str(served), "--host", "0.0.0.0", "--port", port)
    assert "--host 0.0.0.0 can be reached from other machines, and no API key is given" in err
    assert "--no-api-key" in err
    assert cli_main(["serve", str(served), "--host", "0.0.0.0", "--port", port, "--no-api-key"]) == 0
    captured = capsys.readouterr()
    assert "warning: serving on 0.0.0.0 with no API key" in captured.err
    assert "VLLM_API_KEY" not in execs.env and execs.argv[execs.argv.index("--host") + 1] == "0.0.0.0"
    assert "no API key (--no-api-key)" in captured.out


def test_v16_loopback_without_key_is_allowed(fake_venv: Path, served: Path, execs: Exec,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for host in ("127.0.0.1", "localhost"):
        execs.calls.clear()
        assert cli_main(["serve", str(served), "--host", host, "--port", _port()]) == 0
        assert "VLLM_API_KEY" not in execs.env
        assert "no API key: this machine only" in capsys.readouterr().out


def test_v08_api_key_file_keeps_the_key_off_every_argv(fake_venv: Path, served: Path, tmp_path: Path) -> None:
    """The key in a file: not in attnslim's argv, not in vLLM's argv, only in vLLM's VLLM_API_KEY."""
    key_file = tmp_path / "key"
    key_file.write_text("filesecret\n")
    key_file.chmod(0o600)
    args = [str(served), "--port", _port(), "--api-key-file", str(key_file)]
    rc, out, err = _serve_process(args, {})
    assert rc == 0, err
    started = json.loads(out.splitlines()[-1])
    assert started["env"]["VLLM_API_KEY"] == "filesecret"
    assert not any("filesecret" in a for a in args + started["argv"])
    assert "warning" not in err


def test_v08_api_key_option_warns_about_ps(fake_venv: Path, served: Path, execs: Exec,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", str(served), "--port", _port(), "--api-key", "argsecret"]) == 0
    assert execs.env["VLLM_API_KEY"] == "argsecret" and "argsecret" not in " ".join(execs.argv)
    err = capsys.readouterr().err
    assert "--api-key shows the key to every user of this machine (`ps`)" in err and "--api-key-file" in err


@pytest.mark.parametrize("content, mode, message", [
    ("", 0o600, "is empty"),
    ("two words\n", 0o600, "whitespace, control or non-ASCII"),
    ("x" * 5000, 0o600, "larger than 4096 bytes"),
    (b"\xff\xfe", 0o600, "is not text"),
])
def test_v08_bad_key_files_refused(fake_venv: Path, served: Path, tmp_path: Path, execs: Exec,
                                   content: str | bytes, mode: int, message: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    key_file.chmod(mode)
    with pytest.raises(AttnslimError, match=message) as err:
        launch.prepare(launch.ServeArgs(str(served), api_key_file=key_file))
    assert "two words" not in str(err.value)  # the key itself is never printed
    assert execs.calls == []


def test_v08_key_file_not_a_file_or_readable_by_others(fake_venv: Path, served: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for target in ("/dev/zero", str(tmp_path / "missing")):
        link = tmp_path / "keylink"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(AttnslimError, match="--api-key-file .* (is a device|does not exist)"):
            launch.prepare(launch.ServeArgs(str(served), api_key_file=link))
    shared = tmp_path / "shared-key"
    shared.write_text("k3y\n")
    shared.chmod(0o644)
    launch.prepare(launch.ServeArgs(str(served), port=int(_port()), api_key_file=shared))
    assert f"`chmod 600 {shared}`" in capsys.readouterr().err


# --- v22-v24: options vLLM took unchecked ---------------------------------------------------------------------


BAD_OPTIONS = {  # case id -> (option, value, message)
    "v22-inf": ("--kv-cache-gib", "inf", "--kv-cache-gib inf is not a whole number of GiB >= 1"),
    "v22-nan": ("--kv-cache-gib", "nan", "--kv-cache-gib nan is not a whole number of GiB >= 1"),
    "v22-half": ("--kv-cache-gib", "0.5", "--kv-cache-gib 0.5 is not a whole number of GiB >= 1"),
    "v22-fraction": ("--kv-cache-gib", "2.5", "--kv-cache-gib 2.5 is not a whole number of GiB >= 1"),
    "v22-negative": ("--kv-cache-gib", "-3", "--kv-cache-gib -3 is not a whole number of GiB >= 1"),
    "v22-memory": ("--kv-cache-gib", "1e9", "--kv-cache-gib 1e+09 is more than this machine's memory"),
    "v23-negative": ("--max-model-len", "-5", "--max-model-len -5 is not a positive number of tokens"),
    "v23-zero": ("--max-model-len", "0", "--max-model-len 0 is not a positive number of tokens"),
    "v23-beyond": ("--max-model-len", "257", "--max-model-len 257 is above the model's context length "
                   "(max_position_embeddings 256"),
    "v24-garbage": ("--dtype", "garbage", "--dtype 'garbage' is not a dtype vLLM accepts; give one of auto | half"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_v22_v23_v24_options_checked_before_vllm(fake_venv: Path, served: Path, execs: Exec,
                                                  capsys: pytest.CaptureFixture[str], case: str) -> None:
    """--kv-cache-gib, --max-model-len and --dtype went to vLLM unchecked; each is refused naming the bound."""
    option, value, message = BAD_OPTIONS[case]
    assert message in _refused(execs, capsys, str(served), option, value)


def test_v22_v23_v24_valid_options_reach_vllm(fake_venv: Path, served: Path, execs: Exec) -> None:
    options = ["--kv-cache-gib", "2", "--max-model-len", "256", "--dtype", "bfloat16"]
    assert cli_main(["serve", str(served), "--port", _port(), *options]) == 0
    assert execs.env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # vLLM reads it with int()
    assert execs.argv[execs.argv.index("--max-model-len") + 1] == "256"
    assert execs.argv[execs.argv.index("--dtype") + 1] == "bfloat16"


# --- v27-v31: the serve plan reader (shared with the vLLM plugin) -----------------------------------------------


def test_v27_plan_layer_abc_refused(served: Path) -> None:
    _rename_layer(served, "abc")
    with pytest.raises(AttnslimError, match=r"step 1 \(drop\): plan layer 'abc' is not a layer index"):
        layer_kinds(served)


def test_a_factored_lm_head_is_refused_by_the_serve_reader(served: Path) -> None:
    """A recipe's head: section leaves a factored LM head that vLLM cannot load: named before vLLM starts."""
    record = served / "compression.json"
    info = json.loads(record.read_text())
    info["head"] = {"method": "latentllm", "ratio": 0.8, "untie": True}
    record.write_text(json.dumps(info))
    with pytest.raises(AttnslimError, match=r"LM head is factored .* serve it with transformers"):
        layer_kinds(served)


def test_v28_plan_layer_beyond_the_model_refused_like_load(served: Path) -> None:
    import attnslim

    _rename_layer(served, "99")
    with pytest.raises(AttnslimError, match=r"plan layer 99 is beyond the model, whose config.json has 4 layers"):
        layer_kinds(served)
    with pytest.raises(AttnslimError, match="out of range"):
        attnslim.load(served)


def test_v29_plan_layer_minus_one_refused_like_load(served: Path) -> None:
    """"-1" was read as the last layer by the serve reader; attnslim.load refuses it: both refuse it now, by one
    rule (attnslim.plan.layer_index)."""
    import attnslim

    _rename_layer(served, "-1")
    with pytest.raises(AttnslimError, match="plan layer '-1' is not a layer index") as served_err:
        layer_kinds(served)
    with pytest.raises(AttnslimError, match="plan layer '-1' is not a layer index"):
        attnslim.load(served)
    assert "step 1 (drop)" in str(served_err.value)


@pytest.mark.parametrize("edit, message", [
    (lambda info: info["steps"][0].pop("plan"), r"step 1 \(drop\): the plan has no 'layers' mapping"),
    (lambda info: info["steps"][0]["plan"].pop("layers"), r"step 1 \(drop\): the plan has no 'layers' mapping"),
    (lambda info: info.pop("steps"), "is damaged \\(no 'steps' list\\)"),
    (lambda info: info.update(steps={"0": 1}), "is damaged \\(no 'steps' list\\)"),
    (lambda info: info["steps"].__setitem__(0, "drop"), "step 1 is damaged \\(no method name"),
    (lambda info: info["steps"][0]["plan"]["layers"].update({"3": None}), "plan layer '3' -> None is not"),
])
def test_v30_no_plan_or_damaged_plan_refused(served: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    _edit_plan(served, edit)
    with pytest.raises(AttnslimError, match=message):
        layer_kinds(served)


def test_v30_damaged_json_refused_through_the_cli(fake_venv: Path, served: Path, execs: Exec,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (served / "compression.json").write_text('{"steps": [')
    assert "compression.json is damaged" in _refused(execs, capsys, str(served))


def test_v30_deeply_nested_plan_refused(served: Path) -> None:
    """A compression.json nested 200,000 deep (review j13) was a RecursionError in the reader."""
    path = served / "compression.json"
    path.write_text(path.read_text().replace('"steps":', '"notes": ' + "[" * 200_000 + "]" * 200_000 + ', "steps":', 1))
    with pytest.raises(AttnslimError, match="nested too deeply"):
        layer_kinds(served)


def test_v30_nbl_input_agrees_with_the_module() -> None:
    """The reader runs inside vLLM and cannot import LinearizedAttention; its copy of the inputs must match."""
    from attnslim.modules.linearized import INPUTS

    assert NBL_INPUTS == INPUTS


def test_v31_compression_json_to_dev_zero_does_not_fill_memory(fake_venv: Path, served: Path) -> None:
    """compression.json or config.json -> /dev/zero: refused as not a regular file (it was read until MemoryError);
    the server process runs under a 3 GiB address-space cap so the old behaviour fails fast."""
    for name in ("compression.json", "config.json"):
        damaged = served.parent / f"zero-{name}"
        shutil.copytree(served, damaged)
        (damaged / name).unlink()
        (damaged / name).symlink_to("/dev/zero")
        rc, out, err = _serve_process([str(damaged)], {}, memory=3 << 30)
        assert rc == 2 and f"{damaged / name} is a device, FIFO or socket, not a regular file" in err, err


# --- v04 -------------------------------------------------------------------------------------------------------


def test_v04_serve_nosuch_names_what_model_may_be(fake_venv: Path, tmp_path: Path, execs: Exec,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    for model, why in (("nosuch", "no such file or directory"), (str(tmp_path / "empty"), "a directory without "
                       "config.json"), (str(tmp_path / "file"), "not a directory")):
        err = _refused(execs, capsys, model)
        assert f"{model!r}: {why}. MODEL is an attnslim output directory" in err, err
        assert "smollm2-135m" in err and "--offload" not in err
