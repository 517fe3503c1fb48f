"""The demo's stage clock (demo.Stages): what `make demo` prints and keeps against its 6-minute budget."""

from __future__ import annotations

import pytest

from attnslim import demo


def test_stages_time_each_lap_from_the_last_and_the_line_gives_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 130.5, 400.0, 412.25, 420.0])
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    stages = demo.Stages()  # starts at 100
    stages.lap("measure dense")  # 130.5
    stages.lap("compress")  # 400
    stages.lap("save and reload")  # 412.25
    assert stages.seconds == {"measure dense": 30.5, "compress": 269.5, "save and reload": 12.2}
    assert stages.line() == "demo wall time: 320 s (measure dense 30 s, compress 270 s, save and reload 12 s)"


@pytest.mark.parametrize(("generic_mkl", "has_onednn", "expected"),
                         [(True, True, "onednn"), (False, True, "torch"), (True, False, "torch")])
def test_the_demo_measures_on_onednn_only_where_mkl_runs_generic_code(
        monkeypatch: pytest.MonkeyPatch, generic_mkl: bool, has_onednn: bool, expected: str) -> None:
    """Both models of the demo are measured with one kernel, oneDNN exactly where docs/cpu-speed.md says it helps
    (MKL's generic code on a non-Intel CPU) and the build has the op; a model off the CPU stays on torch's."""
    import torch

    from conftest import tiny_llama

    monkeypatch.setattr(demo.host, "mkl_runs_generic_code", lambda: generic_mkl)
    monkeypatch.setattr(demo.host, "onednn_linear_available", lambda: has_onednn)
    model = tiny_llama()
    assert demo.inference_kernel(model) == expected
    monkeypatch.setattr(demo._compat, "input_device", lambda _m: torch.device("meta"))
    assert demo.inference_kernel(model) == "torch"
