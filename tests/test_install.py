"""A non-editable install works outside the checkout: build the wheel, install it into a fresh virtual environment
(dependencies borrowed from this one through a path file, so nothing is downloaded), and run commands from a
directory that is not the checkout. Catches package data that only the checkout has (recipes, the HF entry file)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.real
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True)
    wheel = next((tmp_path / "dist").glob("attnslim-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # a plain path: no editable hook
    # an install of a pure-Python wheel is its unpacking into site-packages; pip with --prefix or --target would
    # first uninstall this checkout's editable attnslim from the running environment
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()

    def attnslim(*argv: str) -> str:
        proc = subprocess.run([str(venv / "bin" / "python"), "-m", "attnslim", *argv], cwd=work, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import attnslim; print(attnslim.__file__)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), f"attnslim imported from {where}, not from the installed wheel"
    assert "--overwrite" in attnslim("demo", "--help")
    listed = attnslim("recipes")  # no benchmark results beside an installed wheel: said, not guessed
    assert "svdllm" in listed and "not measured" in listed and "give --results DIR" in listed
    attnslim("compress", "--recipe", "svdllm", "--set", "steps.0.layers=0:1", "--set", "calibration.windows=2",
             "--set", "calibration.seq_len=64", "--out", "svdllm")
    assert (work / "svdllm" / "attnslim_hf.py").is_file()
    assert "wiki: ppl" in attnslim("eval", "svdllm", "--data", "wiki", "--tokens", "512", "--seq-len", "256")


def test_the_public_names_resolve_without_loading_torch_first():
    code = ("import sys, attnslim; assert 'torch' not in sys.modules; "
            "missing = [n for n in attnslim.__all__ if getattr(attnslim, n, None) is None]; print(missing)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
