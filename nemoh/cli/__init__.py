"""The nemoh command line: `python -m nemoh generate ...` and `python -m nemoh info DIR` (see --help).

A nemoh error (bad input, a broken checkpoint) prints as one line on stderr, `nemoh: error: ...`, and
exits with status 1; a malformed command line exits with status 2 and the usage; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys

from nemoh.cli import generate, info
from nemoh.errors import NemohError


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to every option's help, except required ones and those that say theirs."""

    def _get_help_string(self, action):
        if action.required or "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemoh", description="JAX inference for NVIDIA NemotronH checkpoints.",
                                     epilog="Errors print one line on stderr and exit 1; a malformed command "
                                            "line prints the usage and exits 2.", formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,info}")
    generate.add_parser(sub, _Formatter)
    info.add_parser(sub, _Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except NemohError as e:
        print(f"nemoh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nemoh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
