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
