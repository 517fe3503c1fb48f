"""Re-run the data-loss, code-execution, silent and DoS cases of ../shared/reviews/reliability.md on the real model
through the CLI, and the traceback cases that need the real model; write benchmarks/results/reliability.json.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/reliability_probe.py [--work DIR]

Each case runs `attnslim ...` in a subprocess (stdin closed) and is classified: "clear error" (rc 2, an
`attnslim: error:` line), "held" (rc 0 and the case's own check passes), "traceback" (a Python traceback), or
"FAILED CHECK". The tiny-model regression tests of the same cases are in tests/test_reliability.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "attnslim"]
CHEAP = ["--recipe", "svd", "--set", "steps.0.layers=0:2", "--set", "calibration.windows=4",
         "--set", "calibration.seq_len=128"]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600) -> dict[str, object]:
    proc = subprocess.run(CLI + argv, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    err = proc.stderr.strip().splitlines()
    return {"rc": proc.returncode, "error": next((line for line in err if "attnslim: error:" in line), ""),
            "traceback": "Traceback (most recent call last)" in proc.stderr, "stdout": proc.stdout[-400:]}


def classify(res: dict[str, object], check: Callable[[], bool] | None) -> str:
    if res["traceback"]:
        return "traceback"
    if check is not None and not check():
        return "FAILED CHECK"
    if res["rc"] == 2 and res["error"]:
        return "clear error"
    return "held" if res["rc"] == 0 else f"rc {res['rc']}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    w = Path(args.work or tempfile.mkdtemp(prefix="attnslim-probe-"))
    w.mkdir(parents=True, exist_ok=True)
    base = run(["compress", *CHEAP, "--out", "svd2", "--overwrite"], w)
    assert base["rc"] == 0, base
    sha = (w / "svd2" / "compression.json").read_text()

    def copy(name: str) -> Path:
        shutil.rmtree(w / name, ignore_errors=True)
        shutil.copytree(w / "svd2", w / name)
        return w / name

    def intact() -> bool:
        return (w / "svd2" / "compression.json").read_text() == sha

    cases: list[tuple[str, list[str], Callable[[], bool] | None]] = []
    cases.append(("145 re-compress into its own input with --overwrite",
                  ["compress", "svd2", *CHEAP, "--out", "svd2", "--overwrite"], intact))
    cases.append(("146 compress a compressed directory", ["compress", "svd2", "--recipe", "drop", "--out", "rd"],
                  lambda: not (w / "rd").exists()))
    demo_dir = copy("demo_target")
    (demo_dir / "NOTES.md").write_text("mine")
    cases.append(("149 demo --out an existing attnslim dir", ["demo", "--out", "demo_target"],
                  lambda: (demo_dir / "NOTES.md").exists()))
    evil = copy("evil_tokenizer")
    (evil / "evil_tok.py").write_text(f"open({str(w / 'PWNED_tokenizer')!r}, 'w').write('x')\nclass EvilTok: pass\n")
    tok = json.loads((evil / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTok", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTok"]})
    (evil / "tokenizer_config.json").write_text(json.dumps(tok))
    cases.append(("198 tokenizer auto_map: attnslim inspect", ["inspect", "evil_tokenizer"],
                  lambda: not (w / "PWNED_tokenizer").exists()))
    evil_cfg = copy("evil_autoconfig")
    (evil_cfg / "evil_cfg.py").write_text(f"open({str(w / 'PWNED_autoconfig')!r}, 'w').write('x')\n")
    cfg = json.loads((evil_cfg / "config.json").read_text())
    cfg["auto_map"]["AutoConfig"] = "evil_cfg.EvilConfig"
    (evil_cfg / "config.json").write_text(json.dumps(cfg))
    cases.append(("196 config auto_map: attnslim inspect", ["inspect", "evil_autoconfig"],
                  lambda: not (w / "PWNED_autoconfig").exists()))
    mid = copy("midflip")
    with open(mid / "model.safetensors", "r+b") as f:
        f.seek((mid / "model.safetensors").stat().st_size // 2)
        f.write(b"\x7f" * 4096)
    cases.append(("166 4 KiB of 0x7f in the middle of the weights: eval", ["eval", "midflip", "--data", "wiki",
                                                                           "--tokens", "1024"], None))
    cases.append(("39 ratio=true", ["compress", *CHEAP, "--set", "steps.0.args.ratio=true", "--out", "x1"], None))
    cases.append(("79 linears=qkvo", ["compress", *CHEAP, "--set", "steps.0.args.linears=qkvo", "--out", "x2"], None))
    cases.append(("90 eval --data ''", ["eval", "--data", ""], None))
    cases.append(("115 generate beyond max positions", ["generate", "--prompt", "word " * 9000,
                                                        "--max-new-tokens", "1"], None))
    cases.append(("120 bench --contexts 100000", ["bench", "--contexts", "100000", "--repeats", "1",
                                                  "--new-tokens", "1"], None))
    cases.append(("7 a local path typo (its first part exists here)", ["eval", "svd2/svdlm_1", "--data", "wiki"],
                  None))
    cases.append(("36 ratio=abc", ["compress", *CHEAP, "--set", "steps.0.args.ratio=abc", "--out", "x3"], None))
    cases.append(("114 empty prompt", ["generate", "--prompt", ""], None))
    cases.append(("222 ATTNSLIM_CACHE=''", ["eval", "--data", "wiki", "--tokens", "1024"], None))
    results = []
    for name, argv, check in cases:
        env = {"ATTNSLIM_CACHE": ""} if name.startswith("222") else None
        res = run(argv, w, env)
        results.append({"case": name, "argv": argv[:8], "result": classify(res, check), "error": res["error"]})
        print(f"{results[-1]['result']:>13}  {name}: {res['error'][:150]}", flush=True)
    out = ROOT / "benchmarks" / "results" / "reliability.json"
    out.write_text(json.dumps({"work": str(w), "cases": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
