"""``netdist`` entry point: builds the argparse parser and dispatches to a subcommand.

Each subcommand is a module ``netdist/cli/<name>.py`` exposing::

    def add_parser(subparsers: argparse._SubParsersAction) -> None   # adds its parser(s)
    def run(args: argparse.Namespace) -> int                         # the exit status

and is enabled by adding its module name to ``COMMANDS``. Every listed module is imported
to build the parser, so keep heavy imports (numpy-heavy code, sklearn, ...) inside
``run()``.

Errors: a ``ConfigError`` escaping ``run()`` prints ``netdist <cmd>: error: <message>`` and
exits 2 (as argparse does for bad usage); any other ``NetdistError`` prints the same and
exits 1 (a ``PeerLostError`` / ``TransportClosedError`` as ``error: PeerLostError:
<message>``: one line that says this rank only lost a peer, which ``netdist launch``'s
failure summary marks as a consequence); ``NETDIST_DEBUG=1`` adds the traceback (a switch,
read by ``netdist.config.parse_switch``: a value that is no switch word is itself such a
one-line error). Ctrl-C exits 130. Anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from netdist import __version__
from netdist.config import parse_switch
from netdist.errors import ConfigError, NetdistError, PeerLostError, TransportClosedError

__all__ = ["COMMANDS", "build_parser", "format_error", "main"]

COMMANDS: tuple[str, ...] = ("launch", "worker", "demo", "bench", "ckpt", "trace", "ps_server")
"""Subcommand modules under ``netdist.cli``, in the order ``netdist --help`` lists them."""

EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``netdist`` parser with one subparser per module in ``commands``."""
    parser = argparse.ArgumentParser(
        prog="netdist",
        description="Distributed training over asyncio TCP: launch ranks, run the demo "
                    "job, benchmark the transport, inspect checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"netdist {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if commands is None else commands:
        module = importlib.import_module(f"netdist.cli.{name}")
        before = set(subparsers.choices)
        module.add_parser(subparsers)
        for cmd in set(subparsers.choices) - before:
            subparsers.choices[cmd].set_defaults(_netdist_run=module.run, _netdist_cmd=cmd)
    return parser


def format_error(cmd: str, exc: BaseException) -> str:
    """``netdist <cmd>: error: <message>``, the one line every subcommand prints.

    A lost peer is named by type (``error: PeerLostError: ...``) so that ``netdist
    launch``'s failure summary can tell a consequence (this rank only lost another) from
    a rank's own error.
    """
    lost_peer = isinstance(exc, (PeerLostError, TransportClosedError))
    kind = f"{type(exc).__name__}: " if lost_peer else ""
    return f"netdist {cmd}: error: {kind}{exc}"


def _report(cmd: str, exc: BaseException, *, debug: bool) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(format_error(cmd, exc), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``netdist`` command line with ``argv`` (default ``sys.argv[1:]``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    cmd: str = args._netdist_cmd
    debug = False
    try:
        debug = parse_switch(os.environ, "NETDIST_DEBUG", False)  # a bad value: one line
        status = args._netdist_run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        _report(cmd, exc, debug=debug)
        return EXIT_CONFIG_ERROR
    except NetdistError as exc:
        _report(cmd, exc, debug=debug)
        return EXIT_RUNTIME_ERROR
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
