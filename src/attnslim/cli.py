"""`attnslim` command: thin wrappers over the library API. With --json the last stdout line is JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from attnslim.errors import AttnslimError

DEFAULT_MODEL = "smollm2-135m"
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn

    return deco


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, default=float), flush=True)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def parse_sources(text: str) -> list[str]:
    from attnslim.data import SOURCES

    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SOURCES and not name.startswith("file:"):
            raise AttnslimError(f"unknown text source {name!r}; valid: {', '.join(SOURCES)}, file:PATH")
    return names


def parse_ints(flag: str, text: str) -> list[int]:
    """Comma-separated ints ("512,2048"), or an error naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AttnslimError(f"{flag} {text!r}: expected comma-separated integers, e.g. 512,2048") from None


def build_parser() -> argparse.ArgumentParser:
    from attnslim import cli_commands

    parser = argparse.ArgumentParser(prog="attnslim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli_commands.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_transformers()
    from attnslim.outdir import terminate_as_exit

    try:
        with terminate_as_exit():  # SIGTERM cleans up temp directories like Ctrl-C
            return COMMANDS[args.command](args)
    except AttnslimError as err:
        print(f"attnslim: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
