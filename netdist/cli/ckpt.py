"""``netdist ckpt``: inspect, verify, consolidate and reshard checkpoints.

::

    netdist ckpt inspect DIR                      table of tensors, layouts, files
    netdist ckpt verify DIR                       check sizes, headers, every CRC block
    netdist ckpt consolidate DIR OUT.safetensors  one file with every full tensor
    netdist ckpt reshard DIR --world-size N OUT   rewrite for N ranks
    netdist ckpt reshard DIR --mesh dp=1,tp=4 OUT rewrite for another mesh shape

``DIR`` is a checkpoint directory or a root holding ``step_*`` directories (``latest``
or ``--step`` picks one). Long operations report progress on stderr: redrawn in place on
a terminal, as whole lines (a few, then a final one) when stderr is a file or a pipe.
Bad arguments (an output that is a directory, in a missing directory or inside the
source) are one-line usage errors, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from netdist.checkpoint.options import RESHARD_RANK_OBJECTS  # PURE: enum and errors only

    parser = subparsers.add_parser(
        "ckpt", help="inspect, verify, consolidate or reshard a checkpoint",
        description="Work with netdist distributed checkpoints.")
    commands = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("dir", metavar="DIR",
                       help="checkpoint directory, or a root with step_* directories")
        p.add_argument("--step", type=int, default=None,
                       help="pick step N under a root (default: latest)")

    p = commands.add_parser("inspect", help="table of tensors, dtypes, shapes, layouts")
    common(p)
    p = commands.add_parser("verify", help="check every shard file against its checksums")
    common(p)
    p = commands.add_parser("consolidate", help="write one safetensors file of full tensors")
    common(p)
    p.add_argument("out", metavar="OUT.safetensors")
    p.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    p = commands.add_parser("reshard", help="rewrite the checkpoint for N ranks or a mesh")
    common(p)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--world-size", type=int, metavar="N",
                      help="N ranks without a mesh (mesh-placed tensors split along the "
                           "first dim they shard)")
    size.add_argument("--mesh", type=_mesh_sizes, metavar="NAME=SIZE,...",
                      help="the checkpoint's mesh dims with new sizes (dp=1,tp=4): "
                           "placements kept")
    p.add_argument("out", metavar="OUT", help="new checkpoint directory")
    p.add_argument("--rank-objects", choices=[policy.value for policy in RESHARD_RANK_OBJECTS],
                   default="error",
                   help="how per-rank values map onto the new ranks (default: error)")
    p.add_argument("--no-verify", action="store_true", help="skip checksum verification")


def _mesh_sizes(text: str) -> dict[str, int]:
    """``dp=1,tp=4`` -> ``{"dp": 1, "tp": 4}`` (an argparse type: errors are usage errors)."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            size = int(value)
        except ValueError:
            size = 0
        if not sep or not name or size < 1 or name in sizes:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not NAME=SIZE,... with distinct names and sizes >= 1 "
                f"(e.g. dp=1,tp=4)")
        sizes[name] = size
    return sizes


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


class _ProgressLine:
    """``label: done / total (pct)`` progress on stderr, for use as a context manager.

    On a terminal the line is redrawn in place (``\r``, at most every 0.2 s) and ended by
    :meth:`finish`. Anywhere else (a file, a pipe, a CI log) ``\r`` frames would pile up
    on one line, so progress is written as whole lines: one every ``log_interval`` seconds
    and a final one from :meth:`finish`. Leaving the ``with`` block ends a partly drawn
    line, so an error reported next starts on its own line.
    """

    def __init__(self, label: str, stream: TextIO | None = None, *,
                 interactive: bool | None = None, log_interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = _is_terminal(self.stream) if interactive is None else interactive
        self.log_interval = log_interval
        self._clock = clock
        self._started = clock()
        self._last = self._started
        self._state: tuple[int, int] | None = None
        self._open = False  # a redrawn line without its newline is on the terminal

    def __enter__(self) -> _ProgressLine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end_line()

    def _text(self, done: int, total: int) -> str:
        pct = 100.0 * done / total if total else 100.0
        return f"{self.label}: {_size(done)} / {_size(total)} ({pct:5.1f}%)"

    def __call__(self, done: int, total: int) -> None:
        done = min(done, total)
        self._state = (done, total)
        now = self._clock()
        if self.interactive:
            if now - self._last < 0.2 and done < total and self._open:
                return
            self._last = now
            self.stream.write(f"\r{self._text(done, total)}")
            self.stream.flush()
            self._open = True
        elif now - self._last >= self.log_interval and done < total:
            self._last = now
            self.stream.write(f"{self._text(done, total)}\n")
            self.stream.flush()

    def finish(self) -> None:
        """Report completion: the elapsed time ends the terminal line, or a final whole
        line is written (nothing if no progress was ever reported)."""
        if self._state is None:
            return
        elapsed = self._clock() - self._started
        redraw = "\r" if self.interactive else ""
        self.stream.write(f"{redraw}{self._text(*self._state)}  {elapsed:.1f} s\n")
        self._open = False
        self.stream.flush()
        self._state = None

    def _end_line(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from netdist.checkpoint import inspect_checkpoint
    from netdist.checkpoint.consolidate import mesh_of
    from netdist.sharding import mesh_label

    directory, metadata, rows = inspect_checkpoint(args.dir, args.step)
    total_files = sum(f.size for f in metadata.files)
    print(f"checkpoint {directory}")
    print(f"  format version {metadata.version}, saved by {metadata.num_ranks} rank(s)"
          + (f", step {metadata.step}" if metadata.step is not None else ""))
    mesh = mesh_of(metadata)
    if mesh is not None:
        print(f"  mesh {mesh_label(mesh['shape'], mesh['names'])} (ranks row-major)")
    print(f"  {len(rows)} tensors, {_size(sum(r.nbytes for r in rows))} of tensor data, "
          f"{len(metadata.files)} files, {_size(total_files)} on disk")
    table = [["tensor", "dtype", "shape", "layout", "bytes", "ranks"]]
    for row in rows:
        ranks = ",".join(str(r) for r in row.ranks) if len(row.ranks) <= 8 else \
            f"{row.ranks[0]}..{row.ranks[-1]}"
        table.append([row.name, row.dtype, str(row.full_shape),
                      row.layout, _size(row.nbytes), ranks])
    print(_table(table))
    print(_table([["file", "rank", "size"]] +
                 [[f.name, str(f.rank), _size(f.size)] for f in metadata.files]))
    if metadata.state is not None:
        values = [*metadata.state.objects, *metadata.state.rank_objects]
        per_rank = sorted(metadata.state.rank_objects)
        print(f"  values: {', '.join(values) or '-'}"
              + (f" (per rank: {', '.join(per_rank)})" if per_rank else ""))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from netdist.checkpoint import verify_checkpoint

    with _ProgressLine("verify") as progress:
        report = verify_checkpoint(args.dir, args.step, progress=progress)
        progress.finish()
    if report.ok:
        print(f"OK: {report.path}: {report.files} files, {_size(report.nbytes)} verified")
        return 0
    print(f"FAILED: {report.path}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  {problem}")
    return 1


def _consolidate(args: argparse.Namespace) -> int:
    from netdist.checkpoint import consolidate

    with _ProgressLine("consolidate") as progress:
        out = consolidate(args.dir, args.out, step=args.step, verify=not args.no_verify,
                          progress=progress)
        progress.finish()
    print(f"wrote {out}")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from netdist.checkpoint import reshard_checkpoint
    from netdist.errors import ConfigError
    from netdist.sharding import mesh_label

    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    with _ProgressLine("reshard") as progress:
        metadata = reshard_checkpoint(args.dir, args.out, args.world_size, mesh=args.mesh,
                                      step=args.step, verify=not args.no_verify,
                                      rank_objects=args.rank_objects, progress=progress)
        progress.finish()
    mesh = ""
    if metadata.mesh is not None and args.mesh is not None:
        mesh = f" (mesh {mesh_label(metadata.mesh['shape'], metadata.mesh['names'])})"
    print(f"wrote {args.out}: {metadata.num_ranks} ranks{mesh}, "
          f"{len(metadata.tensor_specs)} tensors")
    return 0


_ACTIONS: dict[str, Any] = {"inspect": _inspect, "verify": _verify,
                            "consolidate": _consolidate, "reshard": _reshard}


def run(args: argparse.Namespace) -> int:
    """Dispatch ``netdist ckpt ACTION``; checkpoint errors propagate as ``NetdistError``."""
    return int(_ACTIONS[args.ckpt_command](args))
