"""``netdist trace``: merge, summarize and explain the traces of a job.

::

    netdist trace merge DIR [-o OUT]              one chrome://tracing / Perfetto file of
                                                  every rank (default DIR/merged.trace.json)
    netdist trace summary DIR [--plot OUT.png] [--json]
                                                  collectives, stragglers, link bandwidth
    netdist trace why DIR                         from the flight-recorder dumps: which rank
                                                  stopped, and where

``DIR`` is where the job wrote ``rank_*.trace.json`` (``NETDIST_TRACE=DIR``) or
``flight_rank_*.json``. A missing, truncated or malformed file is a one-line error naming
it (exit 1); ``--plot`` without matplotlib is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "trace", help="merge, summarize or explain a job's traces and flight dumps",
        description="Offline analysis of netdist traces (NETDIST_TRACE=DIR) and "
                    "flight-recorder dumps.")
    commands = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    p = commands.add_parser("merge", help="merge the per-rank files into one trace file")
    p.add_argument("dir", metavar="DIR", help="directory with rank_*.trace.json")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="merged file (default: DIR/merged.trace.json)")
    p = commands.add_parser("summary", help="collectives, stragglers and link bandwidth")
    p.add_argument("dir", metavar="DIR", help="directory with rank_*.trace.json")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="also draw a timeline PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = commands.add_parser("why", help="which rank stopped, and where (flight dumps)")
    p.add_argument("dir", metavar="DIR", help="directory with flight_rank_*.json")


def run(args: argparse.Namespace) -> int:
    """Run ``netdist trace ACTION``; returns the exit status."""
    action: str = args.trace_command
    if action == "merge":
        return _merge(Path(args.dir), args.output)
    if action == "summary":
        return _summary(Path(args.dir), args.plot, as_json=args.json)
    return _why(Path(args.dir))


def _merge(directory: Path, output: str | None) -> int:
    from netdist.trace.analysis import load_trace_dir, merge

    trace_set = load_trace_dir(directory)
    merged = merge(trace_set)
    out = Path(output) if output is not None else directory / "merged.trace.json"
    _write_json(out, merged)
    missing = trace_set.missing_ranks
    note = f"; missing ranks {', '.join(map(str, missing))}" if missing else ""
    print(f"wrote {out}: {len(merged['traceEvents'])} events of "
          f"{len(trace_set.ranks)} ranks{note}")
    return 0


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` through a temporary file, so a reader never sees half."""
    from netdist.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"output {path} is a directory")
    if not path.parent.is_dir():
        raise ConfigError(f"output directory {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
        fh.write("\n")
    os.replace(tmp, path)


def _summary(directory: Path, plot: str | None, *, as_json: bool) -> int:
    from netdist.errors import ConfigError
    from netdist.trace.analysis import format_summary, load_trace_dir, summarize

    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'netdist[plot]'")
    trace_set = load_trace_dir(directory)
    summary = summarize(trace_set)
    if as_json:
        json.dump(summary.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_summary(summary))
    if plot is not None:
        from netdist.trace.plot import plot_timeline

        written = plot_timeline(trace_set, plot)
        print(f"wrote {written}", file=sys.stderr if as_json else sys.stdout)
    return 0


def _why(directory: Path) -> int:
    from netdist.trace.analysis import explain, load_flight_dir

    print(explain(load_flight_dir(directory)))
    return 0
