"""Re-run, on the real model through the CLI, the cases of ../shared/reviews/reliability.md that ended in data loss,
code execution, silent acceptance, DoS or a traceback; write benchmarks/results/reliability.json.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/reliability_probe.py [--work DIR] [--groups cli,outputs,load,round3]

Each case runs `attnslim ...` in a subprocess (stdin closed unless the case pipes "y") and is classified:
"clear error" (rc 2 and an `attnslim: error:` line), "held" (rc 0), "traceback", or "FAILED CHECK" when the case's
own check (the input intact, no PWNED file, nothing left behind) fails, or "DoS" when it ran past its timeout or out
of its memory cap. Every group run writes benchmarks/results/reliability.json; a subset writes
reliability-GROUPS.json. The tiny-model regression tests of the same
cases are in tests/test_reliability.py. Cases that need strace-widened race windows (155, 207, 209) are covered there
and not re-run here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reliability_damage import DAMAGE, HOLDS
from reliability_round3 import round3_cases

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "attnslim"]
CHEAP = ["--recipe", "svd", "--set", "steps.0.layers=0:2", "--set", "calibration.windows=4",
         "--set", "calibration.seq_len=128"]
NOT_WRITABLE = "/proc/attnslim-probe/out"  # /proc takes no new entries, not even from root
Check = Callable[[], bool]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, stdin: str | None = None,
        timeout: float = 900, cap: int | None = None) -> dict[str, Any]:
    """`attnslim argv` in a subprocess; `cap` bytes of address space (a runaway allocation then fails there); a run
    past `timeout` seconds or out of memory is marked `dos`."""
    limit = None if cap is None else (lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    try:
        proc = subprocess.run(CLI + argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              env={**os.environ, **(env or {})}, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": "", "traceback": False, "dos": True, "stderr": f"still running after {timeout} s"}
    (cwd / ".last_stderr").write_text(proc.stderr)
    lines = proc.stderr.strip().splitlines()
    return {"rc": proc.returncode, "error": next((x for x in lines if "attnslim: error:" in x), ""),
            "traceback": "Traceback (most recent call last)" in proc.stderr, "stderr": proc.stderr[-300:],
            "dos": "MemoryError" in proc.stderr or "Cannot allocate memory" in proc.stderr}


def classify(res: dict[str, object], check: Check | None) -> str:
    if res["dos"]:
        return "DoS"
    if res["traceback"]:
        return "traceback"
    if check is not None and not check():
        return "FAILED CHECK"
    if res["rc"] == 2 and res["error"]:
        return "clear error"
    return "held" if res["rc"] == 0 else f"rc {res['rc']}"


class Probe:
    def __init__(self, work: Path) -> None:
        self.w = work
        self.results: list[dict[str, Any]] = []
        base = run(["compress", *CHEAP, "--out", "svd2", "--overwrite"], work)
        assert base["rc"] == 0, base
        d = work / "svd2"
        self.sha = (d / "model.safetensors").stat().st_size, (d / "compression.json").read_text()

    def copy(self, name: str, source: str = "svd2") -> Path:
        shutil.rmtree(self.w / name, ignore_errors=True)
        shutil.copytree(self.w / source, self.w / name)
        return self.w / name

    def intact(self) -> bool:
        d = self.w / "svd2"
        return ((d / "model.safetensors").stat().st_size, (d / "compression.json").read_text()) == self.sha

    def case(self, name: str, argv: list[str], check: Check | None = None, env: dict[str, str] | None = None,
             stdin: str | None = None, expect: str = "clear error", timeout: float = 900,
             cap: int | None = None) -> None:
        res = run(argv, self.w, env, stdin, timeout, cap)
        result = classify(res, check)
        self.results.append({"case": name, "argv": argv[:10], "result": result, "expected": expect,
                             "error": res["error"] or res["stderr"][-200:]})
        print(f"{result:>13}  {name}: {str(res['error'])[:140]}", flush=True)

    def record(self, name: str, result: str, detail: str) -> None:
        self.results.append({"case": name, "argv": [], "result": result, "expected": "held", "error": detail})
        print(f"{result:>13}  {name}: {detail[:140]}", flush=True)


def cli_cases(p: Probe) -> None:
    w = p.w
    (w / "latin1.yaml").write_bytes("name: caf\xe9\nsteps: [{method: svd}]\n".encode("latin-1"))
    (w / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (w / "latin1.txt").write_bytes(("caf\xe9 " * 400 + "\n\n").encode("latin-1") * 20)
    (w / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (w / "run.sh").write_text("#!/bin/sh\n")
    levels = ["name: bomb", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 10)}]" for i in range(1, 8)]
    (w / "bomb7.yaml").write_text("\n".join(levels + ["steps: [{method: svd, args: {bogus: *a7}}]"]))
    out = ["--out", "x"]
    p.case("25 non-UTF-8 recipe", ["compress", "--recipe", "latin1.yaml", *out])
    p.case("26 binary recipe", ["compress", "--recipe", "binary.yaml", *out])
    p.case("28 YAML alias bomb (depth 7)", ["compress", "--recipe", "bomb7.yaml", *out])
    for name, arg in [("36 ratio=abc", "ratio=abc"), ("37 ratio='\"0.5\"'", "ratio='\"0.5\"'"),
                      ("38 ratio=[0.5]", "ratio=[0.5]"), ("39 ratio=true", "ratio=true"),
                      ("79 linears=qkvo", "linears=qkvo"), ("82 damp=abc", "damp=abc")]:
        p.case(name, ["compress", *CHEAP, "--set", f"steps.0.args.{arg}", *out])
    p.case("83 svdllm damp=.inf", ["compress", "--recipe", "svdllm", "--set", "steps.0.args.damp=.inf", *out])
    p.case("84 asvd alpha=x", ["compress", "--recipe", "asvd", "--set", "steps.0.args.alpha=x", *out])
    p.case("85 drop count='\"3\"'", ["compress", "--recipe", "drop", "--set", "steps.0.args.count='\"3\"'", *out])
    p.case("90 eval --data ''", ["eval", "--data", ""])
    p.case("96 file: binary text", ["eval", "--data", "file:binary.txt", "--tokens", "512"])
    p.case("97 file: Latin-1 text", ["eval", "--data", "file:latin1.txt", "--tokens", "512"])
    p.case("100 calibration.source=file:latin1.txt", ["compress", *CHEAP, "--set",
                                                      "calibration.source=file:latin1.txt", *out])
    p.case("114 empty prompt", ["generate", "--prompt", ""])
    p.case("115 generate beyond max positions", ["generate", "--prompt", "word " * 9000, "--max-new-tokens", "1"])
    p.case("120 bench --contexts 100000", ["bench", "--contexts", "100000", "--repeats", "1", "--new-tokens", "1"])
    p.case("222 ATTNSLIM_CACHE=''", ["eval", "--data", "wiki", "--tokens", "1024"], env={"ATTNSLIM_CACHE": ""})
    (w / "cache_file").write_text("x")
    p.case("221 ATTNSLIM_CACHE is a file", ["eval", "--data", "wiki"], env={"ATTNSLIM_CACHE": str(w / "cache_file")})
    p.case("218 read-only empty cache", ["eval", "--data", "wiki"], env={"ATTNSLIM_CACHE": NOT_WRITABLE})


def output_cases(p: Probe) -> None:
    w = p.w
    (w / "emptyd").mkdir(exist_ok=True)
    for link, target in [("link_to_model", "svd2"), ("link_to_empty", "emptyd"), ("link_dangling", "nowhere")]:
        if not (w / link).is_symlink():
            (w / link).symlink_to(w / target)
    p.case("145 re-compress into its own input with --overwrite",
           ["compress", "svd2", *CHEAP, "--out", "svd2", "--overwrite"], p.intact)
    p.case("146 compress a compressed directory", ["compress", "svd2", "--recipe", "drop", "--out", "rd"],
           lambda: not (w / "rd").exists())
    p.case("147 compress svd2 on its own layers", ["compress", "svd2", *CHEAP, "--out", "again"], p.intact)
    p.case("139 --out run.sh/sub", ["compress", *CHEAP, "--out", "run.sh/sub"])
    p.case("140 --out in a parent that cannot be written", ["compress", *CHEAP, "--out", NOT_WRITABLE])
    p.case("142 --out link_to_model --overwrite", ["compress", *CHEAP, "--out", "link_to_model", "--overwrite"],
           p.intact)
    p.case("143 --out link_to_empty --overwrite", ["compress", *CHEAP, "--out", "link_to_empty", "--overwrite"])
    p.case("144 --out link_dangling", ["compress", *CHEAP, "--out", "link_dangling"])
    demo_dir = p.copy("demo_target")
    (demo_dir / "NOTES.md").write_text("mine")
    p.case("149 demo --out an existing attnslim dir", ["demo", "--out", "demo_target"],
           lambda: (demo_dir / "NOTES.md").exists())
    stale = w / ".kout4-killed"
    stale.mkdir(exist_ok=True)
    (stale / ".attnslim-writer").write_text("999999")
    res = run(["compress", *CHEAP, "--out", "kout4"], w)
    reported = "left by an interrupted write" in str(res["stderr"])
    p.record("153 SIGKILL during save: reported by the next save", "held" if reported and res["rc"] == 0
             else "FAILED CHECK", str(res["stderr"])[-200:])
    sigterm_case(p)
    concurrent_case(p)


def sigterm_case(p: Probe) -> None:
    """154: SIGTERM while the model is being written leaves no temp directory."""
    proc = subprocess.Popen(CLI + ["compress", *CHEAP, "--out", "kout6"], cwd=p.w, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not list(p.w.glob(".kout6-*")) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    left = list(p.w.glob(".kout6-*"))
    p.record("154 SIGTERM during save", "held" if rc == 143 and not left else "FAILED CHECK",
             f"rc {rc}, temp directories left: {[str(x) for x in left]}")


def concurrent_case(p: Probe) -> None:
    """205: two compresses to the same --out without --overwrite: one saves, the other fails, nothing vanishes."""
    procs = [subprocess.Popen(CLI + ["compress", *CHEAP, "--set", f"steps.0.args.ratio={r}", "--out", "same"],
                              cwd=p.w, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for r in (0.5, 0.9)]
    outs = [(proc.wait(timeout=900), proc.communicate()) for proc in procs]
    rcs = sorted(rc for rc, _ in outs)
    ok = rcs == [0, 2] and (p.w / "same" / "compression.json").is_file()
    p.record("205 two compresses, same --out", "held" if ok else "FAILED CHECK",
             f"return codes {rcs}; " + " | ".join(o[1][1].strip().splitlines()[-1][:120] for o in outs if o[1][1]))


def load_cases(p: Probe) -> None:
    w = p.w
    for name, damage in {**DAMAGE, **HOLDS}.items():
        d = p.copy("damaged")
        damage(d)
        p.case(name, ["inspect", "damaged"], expect="held" if name in HOLDS else "clear error")
    evil = p.copy("evil_tokenizer")
    (evil / "evil_tok.py").write_text(f"open({str(w / 'PWNED_tokenizer')!r}, 'w').write('x')\nclass EvilTok: pass\n")
    tok = json.loads((evil / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTok", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTok"]})
    (evil / "tokenizer_config.json").write_text(json.dumps(tok))
    evil_cfg = p.copy("evil_autoconfig")
    (evil_cfg / "evil_cfg.py").write_text(f"open({str(w / 'PWNED_autoconfig')!r}, 'w').write('x')\n")
    cfg = json.loads((evil_cfg / "config.json").read_text())
    cfg["auto_map"]["AutoConfig"] = "evil_cfg.EvilConfig"
    (evil_cfg / "config.json").write_text(json.dumps(cfg))
    no_tok, no_cfg = (lambda: not (w / "PWNED_tokenizer").exists()), (lambda: not (w / "PWNED_autoconfig").exists())
    p.case("195 config auto_map, stdin closed: inspect", ["inspect", "evil_autoconfig"], no_cfg, expect="held")
    p.case("196 config auto_map, 'y' piped: inspect", ["inspect", "evil_autoconfig"], no_cfg, stdin="y\n",
           expect="held")
    p.case("198 tokenizer auto_map, 'y' piped: inspect", ["inspect", "evil_tokenizer"], no_tok, stdin="y\n")
    hf_cases(p)
    p.case("7 a local path typo (its first part exists here)", ["eval", "svd2/svdlm_1", "--data", "wiki"])
    hf = w / "hf_config_only"
    hf.mkdir(exist_ok=True)
    shutil.copy(w / "svd2" / "config.json", hf / "config.json")
    p.case("10 HF dir with config.json only", ["eval", "hf_config_only", "--data", "wiki"])
    mid = p.copy("midflip")
    with open(mid / "model.safetensors", "r+b") as f:
        f.seek((mid / "model.safetensors").stat().st_size // 2)
        f.write(b"\x7f" * 4096)
    p.case("166 4 KiB of 0x7f in the middle of the weights: eval", ["eval", "midflip", "--data", "wiki",
                                                                    "--tokens", "1024"])


def hf_cases(p: Probe) -> None:
    """199/200: loading with transformers itself (the documented trust_remote_code paths)."""
    code = ("import sys\nfrom transformers import AutoModelForCausalLM\ntry:\n"
            "    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == '1')\n"
            "    print('LOADED')\nexcept ValueError as e:\n    print('REFUSED', str(e).splitlines()[0][:120])\n")
    for name, directory, trust, want in [("200 transformers without trust_remote_code", "svd2", "0", "REFUSED"),
                                         ("199 tokenizer auto_map via transformers trust_remote_code=True",
                                          "evil_tokenizer", "1", "REFUSED")]:
        proc = subprocess.run([sys.executable, "-c", code, directory, trust], cwd=p.w, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
        pwned = (p.w / "PWNED_tokenizer").exists()
        ok = proc.stdout.startswith(want) and not pwned
        p.record(name, "clear error" if ok else "FAILED CHECK",
                 (proc.stdout.strip() or proc.stderr.strip().splitlines()[-1])[:200])


GROUPS: dict[str, Callable[[Probe], None]] = {"cli": cli_cases, "outputs": output_cases, "load": load_cases,
                                              "round3": round3_cases}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default=None)
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="attnslim-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    probe = Probe(work)
    unknown = set(args.groups.split(",")) - set(GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    for name in args.groups.split(","):
        GROUPS[name](probe)
    counts: dict[str, int] = {}
    for r in probe.results:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    groups = args.groups.split(",")
    suffix = "" if sorted(groups) == sorted(GROUPS) else "-" + "-".join(groups)
    out = ROOT / "benchmarks" / "results" / f"reliability{suffix}.json"
    command = "OMP_NUM_THREADS=2 .venv/bin/python benchmarks/reliability_probe.py" + (
        f" --groups {args.groups}" if suffix else "")
    out.write_text(json.dumps({"cases": probe.results, "counts": counts, "command": command}, indent=1))
    print(f"{counts}\nwrote {out}")


if __name__ == "__main__":
    main()
