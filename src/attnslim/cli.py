"""`attnslim` command: thin wrappers over the library API. With --json the last stdout line is JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attnslim import cli_analyze, cli_commands, cli_compress, cli_measure, cli_parsers
from attnslim.errors import AttnslimError
from attnslim.outdir import terminate_as_exit


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


COMMAND_MODULES = (cli_analyze, cli_compress, cli_measure)  # imported for their @command registrations


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnslim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli_parsers.add_parsers(sub)
    cli_parsers.add_examples(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_transformers()
    try:
        with terminate_as_exit():  # SIGTERM cleans up temp directories like Ctrl-C
            return cli_commands.COMMANDS[args.command](args)
    except AttnslimError as err:
        print(f"attnslim: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
