"""Bad command lines fail with exit code 2 and a message naming the problem, before any model is loaded."""

from __future__ import annotations

import pytest

from attnslim.cli import main as cli_main


@pytest.fixture
def no_model_loading(monkeypatch):
    """Every case must be refused before a model loads: loading one fails the test."""
    import attnslim.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(attnslim.models, "load_model", refuse)


@pytest.mark.parametrize("argv,message", [
    (["compress", "--set", "calibration.windows=[", "--out", "{tmp}/x"], "--set calibration.windows=[: the value"),
    (["analyze", "--what", "conversion", "--arg", "rank=["], "--arg rank=[: the value '[' is not valid YAML"),
    (["bench", "--contexts", "512,abc"], "--contexts '512,abc': expected comma-separated integers"),
    (["bench", "--repeats", "0"], "need --repeats ≥ 1"),
    (["generate", "--prompt", "A", "--offload", "--cpu-linear", "onednn"], "--cpu-linear onednn with --offload is not"),
    (["eval", "--batch-size", "0"], "need --batch-size ≥ 1"),
    (["eval", "--choice", "0"], "--choice ≥ 1"),
    (["compress", "--out", "{tmp}/data", "--overwrite"], "not a model saved by attnslim"),
])
def test_bad_command_lines_are_refused_before_loading(argv, message, tmp_path, capsys, no_model_loading):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a model")
    assert cli_main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "data" / "notes.txt").exists() and not (tmp_path / "x").exists()


def test_a_directory_that_is_no_model_is_named(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a model directory (no config.json" in capsys.readouterr().err
