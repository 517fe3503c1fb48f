"""Round 3 of ../shared/reviews/reliability.md: the cases that ran through the CLI and ended in data loss, code
execution, DoS, silence or a traceback, re-run on the real model (benchmarks/reliability_probe.py --groups round3).

Every case names its review id. Cases that could hang or exhaust memory run under a timeout and an address-space
cap: hitting either is classified "DoS". Serving cases use a stand-in serving environment whose python prints the
argv and VLLM_* variables it was started with, so no vLLM is needed. The tiny-model regression tests of the same ids
are in tests/test_reliability_{files,serve,inputs}.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

Check = Callable[[], bool]
CAP = 4 << 30  # bytes of address space for the cases that used to exhaust memory
MLA = ["--recipe", "mla-oneshot", "--set", "steps.0.layers=0:2", "--set", "calibration.windows=4",
       "--set", "calibration.seq_len=128", "--set", "steps.0.args.refit_o=false"]


class ProbeLike(Protocol):
    w: Path

    def copy(self, name: str, source: str = "svd2") -> Path: ...

    def case(self, name: str, argv: list[str], check: Check | None = None, env: dict[str, str] | None = None,
             stdin: str | None = None, expect: str = "clear error", timeout: float = 900,
             cap: int | None = None) -> None: ...

    def record(self, name: str, result: str, detail: str) -> None: ...


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _unchanged(path: Path, text: str) -> Check:
    return lambda: path.read_text() == text


def link_cases(p: ProbeLike) -> None:
    """F1-F3: writes through links (s06, s07), files that are not files (s02-s05)."""
    w = p.w
    victim = w / "victim.txt"
    victim.write_text("a user's file\n")
    d = p.copy("r_link")
    (d / "report.html").symlink_to(victim)
    p.case("s06 report.html -> a file outside the directory", ["report", "r_link"],
           _unchanged(victim, "a user's file\n"))
    rc = w / "fake_rc"
    rc.write_text("# my shell rc\n")
    d = p.copy("r_rc")
    _edit_json(d / "compression.json", lambda v: v.update(base_model="$(touch PWNED_report;"))
    (d / "report.md").symlink_to(rc)
    p.case("s07 report.md -> rc stand-in, crafted base_model", ["report", "r_rc"], _unchanged(rc, "# my shell rc\n"))
    d = p.copy("z_zero")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/dev/zero")
    p.case("s02 weights -> /dev/zero", ["eval", "z_zero", "--tokens", "512"], timeout=120)
    d = p.copy("z_fifo")
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    p.case("s03 weights a FIFO", ["eval", "z_fifo", "--tokens", "512"], timeout=120)
    for case, name, command in [("s04", "config.json", "eval"), ("s05", "compression.json", "report")]:
        d = p.copy(f"y_{case}")
        (d / name).unlink()
        (d / name).symlink_to("/dev/zero")
        p.case(f"{case} {name} -> /dev/zero ({command})", [command, f"y_{case}"], timeout=120, cap=CAP)


def size_cases(p: ProbeLike) -> None:
    """F6: sizes from directories and arguments bounded before allocation."""
    d = p.copy("c02")
    _edit_json(d / "config.json", lambda v: v.update(num_hidden_layers=10**6))
    p.case("c02 num_hidden_layers 10^6", ["eval", "c02", "--tokens", "512"], timeout=120, cap=CAP)
    d = p.copy("c03b")
    _edit_json(d / "config.json", lambda v: v.update(intermediate_size=200_000))
    p.case("c03b intermediate_size 200000", ["eval", "c03b", "--tokens", "512"], timeout=120, cap=CAP)
    p.case("m27b mla rope_span=10^8", ["compress", *MLA, "--set", "steps.0.args.rope_span=100000000",
                                       "--out", "x"], timeout=300, cap=CAP)
    p.case("h09 calibration.windows=10^9", ["compress", "--recipe", "svd", "--set", "steps.0.layers=0:2",
                                            "--set", "calibration.windows=1000000000", "--out", "x"],
           timeout=300, cap=CAP)
    p.case("a08 analyze --windows 10^9 (linearity)", ["analyze", "--what", "linearity", "--windows", "1000000000"],
           timeout=300, cap=CAP)
    p.case("a08 analyze --windows 10^9 (similarity: capped at 8, said)", ["analyze", "--what", "similarity",
                                                                         "--windows", "1000000000"],
           lambda: "reads at most 8 for --windows" in (p.w / ".last_stderr").read_text(), timeout=600, cap=CAP,
           expect="held")


def heal_cases(p: ProbeLike) -> None:
    """F7: heal settings that cannot work are refused before the compression; a diverging heal writes nothing."""
    heal = ["--set", "heal.steps=2", "--set", "heal.batch_size=1", "--set", "heal.seq_len=64"]
    gone = lambda: not (p.w / "hx").exists()  # noqa: E731
    p.case("h01 heal.lr=.inf", ["compress", *MLA, *heal, "--set", "heal.lr=.inf", "--out", "hx"], gone)
    p.case("h05 heal.seed=abc", ["compress", *MLA, *heal, "--set", "heal.seed=abc", "--out", "hx"], gone)


def integrity_cases(p: ProbeLike) -> None:
    """F8: a format version that promises no checksum, or a bool, is not a way around the check."""
    d = p.copy("j16")
    _edit_json(d / "compression.json", lambda v: (v.update(format_version=True), v.pop("weights_sha256")))
    p.case("j16 format_version true without weights_sha256", ["eval", "j16", "--tokens", "512"])
    d = p.copy("j13")
    text = (d / "compression.json").read_text()
    (d / "compression.json").write_text(text.replace('"recipe":', '"notes": ' + "[" * 200_000 + "]" * 200_000
                                                     + ', "recipe":', 1))
    p.case("j13 compression.json nested 200,000 deep (eval)", ["eval", "j13", "--tokens", "512"])
    p.case("j13 compression.json nested 200,000 deep (report)", ["report", "j13"])
    d = p.copy("r01r")
    _edit_json(d / "compression.json", lambda v: v.pop("kv_bytes_per_token_before", None))
    p.case("r01r report: kv_bytes_per_token_before missing", ["report", "r01r"], expect="held")


def regression_cases(p: ProbeLike) -> None:
    """F5 and F10's unclear errors."""
    p.case("n_inspect_svd inspect an svd output", ["inspect", "svd2"], expect="held")
    p.case("n_bench_svd bench an svd output", ["bench", "svd2", "--contexts", "64", "--repeats", "1",
                                               "--new-tokens", "2"], expect="held")
    secret = p.w / "passwd_standin"
    secret.write_text("root:x:0:0:SECRET-LINE:/root:/bin/bash\n")
    p.case("n_recipe_passwd --recipe of a non-recipe file", ["compress", "--recipe", str(secret), "--out", "x"],
           lambda: "SECRET-LINE" not in (p.w / ".last_stderr").read_text())
    p.case("m25 mla rank=0 with kv_ratio=null", ["compress", *MLA, "--set", "steps.0.args.kv_ratio=null",
                                                "--set", "steps.0.args.rank=0", "--out", "x"])


def serve_cases(p: ProbeLike) -> None:
    """F4: a stand-in serving environment records what the server would have been started with."""
    venv = p.w / "fakevenv"
    site = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    site.mkdir(parents=True, exist_ok=True)
    (site / "__init__.py").write_text("")
    (venv / "bin").mkdir(exist_ok=True)
    log = p.w / "fakevenv.log"
    (venv / "bin" / "python").write_text(
        "#!/bin/sh\n{ echo \"$@\"; env | grep '^VLLM_' | sed 's/=.*/=<set>/'; } > " + str(log) + "\n")
    (venv / "bin" / "python").chmod(0o755)
    env = {"ATTNSLIM_SERVE_VENV": str(venv)}
    log.unlink(missing_ok=True)
    p.case("v09 VLLM_API_KEY from the environment", ["serve", "smollm2-135m", "--port", "18126"],
           lambda: log.is_file() and "VLLM_API_KEY=<set>" in log.read_text(), env={**env, "VLLM_API_KEY": "s"},
           expect="held")
    p.case("v16 --host ''", ["serve", "smollm2-135m", "--host", ""], env=env)
    p.case("v22 --kv-cache-gib inf", ["serve", "smollm2-135m", "--kv-cache-gib", "inf"], env=env)
    p.case("v23 --max-model-len -5", ["serve", "smollm2-135m", "--max-model-len", "-5"], env=env)
    p.case("v24 --dtype garbage", ["serve", "smollm2-135m", "--dtype", "garbage"], env=env)
    p.case("v04 serve nosuch", ["serve", "nosuch"], env=env)


def round3_cases(p: ProbeLike) -> None:
    for group in (link_cases, size_cases, heal_cases, integrity_cases, regression_cases, serve_cases):
        group(p)
    shutil.rmtree(p.w / "x", ignore_errors=True)
