"""`attnslim analyze`: the papers' motivating analyses, each reading a capped sample (SAMPLE_CAPS)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from attnslim.cli_commands import command, emit_json
from attnslim.errors import AttnslimError

ANALYSES = ("linearity", "lowrank", "similarity", "sensitivity", "conversion")


def _method_from_cli(name: str, items: list[str]) -> Any:
    """A method instance from --method and its --arg KEY=VALUE items (values parsed as YAML)."""
    from attnslim.errors import AttnslimError
    from attnslim.methods import lookup_method
    from attnslim.recipe import yaml_value

    args = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise AttnslimError(f"--arg {item!r} must look like key=value, e.g. --arg rank=0.25")
        args[key] = yaml_value(raw, f"--arg {item}")
    return lookup_method(name).from_args(args)


# the analyses that read a fixed small sample whatever --windows / --seq-len ask (their cost grows with L²·layers)
SAMPLE_CAPS = {"lowrank": (8, None), "similarity": (8, 256), "sensitivity": (4, 256), "conversion": (None, 256)}


def _capped(args: argparse.Namespace) -> None:
    """Say when an analysis reads fewer windows or shorter ones than asked (never a silent clamp)."""
    windows, seq_len = SAMPLE_CAPS.get(args.what, (None, None))
    for name, cap, asked in (("--windows", windows, args.windows), ("--seq-len", seq_len, args.seq_len)):
        if cap is not None and asked > cap:
            print(f"analyze: --what {args.what} reads at most {cap} for {name}; using {cap} (asked {asked})",
                  file=sys.stderr, flush=True)


def _cap(asked: int, what: str, which: int) -> int:
    """`asked` limited by SAMPLE_CAPS[what][which] (0: windows, 1: seq_len), the one place the caps are written."""
    cap = SAMPLE_CAPS[what][which]
    return asked if cap is None else min(asked, cap)


def _analysis(args: argparse.Namespace, model: Any, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """Run one analysis; (report, text table)."""
    _capped(args)
    if args.what == "linearity":
        from attnslim.analysis.linearity import format_linearity, linearity_report

        calibration = {"source": args.source, "windows": args.windows, "seq_len": args.seq_len, "seed": 0}
        report = linearity_report(model, tokenizer, calibration, args.m)
        return report, format_linearity(report)
    if args.what == "lowrank":
        from attnslim.analysis.lowrank import format_lowrank, lowrank_report

        report = lowrank_report(model, tokenizer, args.source, n=_cap(args.windows, "lowrank", 0))
        return report, format_lowrank(report)
    if args.what == "conversion":
        from attnslim.adapters import get_adapter
        from attnslim.analysis.conversion import conversion_report, format_conversion
        from attnslim.recipe import resolve_layers, selector_from_text

        method = _method_from_cli(args.method, args.arg)
        layers = resolve_layers(selector_from_text(args.layers), get_adapter(model).num_layers())
        report = conversion_report(model, tokenizer, method, args.source, n=args.windows,
                                   context=_cap(args.seq_len, "conversion", 1), layers=layers)
        return report, format_conversion(report)
    from attnslim.analysis import similarity

    if args.what == "similarity":
        report = similarity.similarity_report(model, tokenizer, args.source, n=_cap(args.windows, "similarity", 0),
                                              seq_len=_cap(args.seq_len, "similarity", 1))
        return report, similarity.format_similarity(report)
    report = similarity.sensitivity_report(model, tokenizer, args.source, n=_cap(args.windows, "sensitivity", 0),
                                           seq_len=_cap(args.seq_len, "sensitivity", 1))
    return report, similarity.format_sensitivity(report)


@command("analyze")
def cmd_analyze(args: argparse.Namespace) -> int:
    from attnslim.errors import AttnslimError
    from attnslim.models import load_model

    if args.what not in ANALYSES:
        raise AttnslimError(f"unknown analysis {args.what!r}; valid: {', '.join(ANALYSES)}")
    if (args.arg or args.layers != "all") and args.what != "conversion":
        raise AttnslimError(f"--arg and --layers are read by --what conversion only, not {args.what!r}")
    if args.what == "conversion":
        from attnslim.recipe import selector_from_text

        _method_from_cli(args.method, args.arg)  # bad method arguments and selectors fail before the model loads
        selector_from_text(args.layers)
    if args.plot:
        check_plot_path(args.plot)
    model, tokenizer = load_model(args.model)
    report, text = _analysis(args, model, tokenizer)
    print(text)
    if args.plot:
        from pathlib import Path

        from attnslim.analysis.plots import analysis_svg

        Path(args.plot).write_text(analysis_svg(args.what, report))
        print(f"figures: {args.plot}")
    if args.json:
        emit_json(report)
    return 0


def check_plot_path(plot: str) -> None:
    """--plot's file can be written: its directory exists and is writable, and it is not a directory itself;
    checked before the model loads, not after the analysis ran (reliability round 3, a07)."""
    import os
    from pathlib import Path

    path = Path(plot).expanduser()
    parent = path.parent
    if path.is_dir():
        raise AttnslimError(f"--plot {plot}: is a directory; give a file name such as {path / 'figures.svg'}")
    if not parent.is_dir():
        raise AttnslimError(f"--plot {plot}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AttnslimError(f"--plot {plot}: the directory {parent} is not writable; choose another path")
