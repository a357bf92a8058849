"""``netdist trace``: merge, summarize and explain the traces of a job.

::

    netdist trace merge DIR [-o OUT] [--html OUT.html]
                                                  one chrome://tracing / Perfetto file of
                                                  every rank (default DIR/merged.trace.json);
                                                  --html: also the offline viewer page with
                                                  the merged trace embedded
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
    p.add_argument("--html", metavar="OUT.html", default=None,
                   help="also write the viewer page with the merged trace embedded (one "
                        "file that opens offline in any browser)")
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
        return _merge(Path(args.dir), args.output, args.html)
    if action == "summary":
        return _summary(Path(args.dir), args.plot, as_json=args.json)
    return _why(Path(args.dir))


def _merge(directory: Path, output: str | None, html: str | None = None) -> int:
    from netdist.trace.analysis import load_trace_dir, merge

    out = Path(output) if output is not None else directory / "merged.trace.json"
    page = Path(html) if html is not None else None
    _check_output(out)
    if page is not None:
        _check_output(page)
    trace_set = load_trace_dir(directory)
    merged = merge(trace_set)
    _write_json(out, merged)
    missing = trace_set.missing_ranks
    note = f"; missing ranks {', '.join(map(str, missing))}" if missing else ""
    what = f"{len(merged['traceEvents'])} events of {len(trace_set.ranks)} ranks{note}"
    print(f"wrote {out}: {what}")
    if page is not None:
        from netdist.trace.viewer import render_viewer

        _write_text(page, render_viewer(merged))
        print(f"wrote {page}: viewer of {what}")
    return 0


def _check_output(path: Path) -> None:
    """A ConfigError (usage, exit 2) when ``path`` cannot be written as a file."""
    from netdist.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"output {path} is a directory")
    if not path.parent.is_dir():
        raise ConfigError(f"output directory {path.parent} does not exist")


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` through a temporary file, so a reader never sees half."""
    _write_text(path, json.dumps(obj) + "\n")


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half."""
    _check_output(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
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
