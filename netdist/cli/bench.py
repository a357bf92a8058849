"""``netdist bench OP -n N --sizes 8:256M``: benchmark collectives or point-to-point.

Run directly, it starts N local ranks (``netdist.launcher.launch``) that each run this
command again as workers; with ``--layout 2x2`` it starts them on test hosts instead
(``netdist.cli.bench_cluster``: network namespaces on a switch, as root); run under
``netdist launch`` (``NETDIST_RANK`` is set) it *is* a worker. Rank 0 prints an
nccl-tests-style table (time median/min/max, algbw, busbw, correctness check), then, as
``#`` lines, the bytes it exchanged over the whole run per peer and per host link
(``Transport.traffic``, warm-up included); ``--json`` writes the rows (and rank 0's
traffic total), ``--plot`` draws busbw against size (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from typing import Any

__all__ = ["add_parser", "run"]

_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "p2p")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")

_EPILOG = """\
sizes: MIN:MAX doubles from MIN to MAX, MIN:MAX:F multiplies by F, or a comma list;
units K, M, G are binary (1M = 1048576 bytes).
busbw (nccl-tests): algbw * 2(n-1)/n for all_reduce, * (n-1)/n for reduce_scatter
and all_gather, * 1 for broadcast.

examples:
  netdist bench all_reduce -n 4 --sizes 8:256M
  netdist launch -n 2 -- netdist bench p2p
  netdist bench all_gather -n 4 --sizes 1M:64M:4 --json ag.json --plot ag.png
  netdist bench all_reduce --layout 2x2 --rate-mbit 1000 --sizes 1M:64M:4   # as root
"""


def _size(text: str) -> int:
    from netdist.collectives.benchmark import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark collectives and point-to-point transfers",
        description="Measure a collective (or p2p latency/bandwidth) over real TCP between "
                    "local ranks and print an nccl-tests-style table.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("op", choices=_OPS, help="what to measure")
    parser.add_argument("-n", "--nprocs", type=int, default=None, metavar="N",
                        help="ranks to start (default 2; ignored under netdist launch)")
    parser.add_argument("--sizes", default=None, metavar="MIN:MAX",
                        help="message sizes in bytes (default 8:64M; p2p: 8,64K,1M,64M)")
    parser.add_argument("--iters", type=int, default=20, metavar="K",
                        help="timed iterations per size (default 20)")
    parser.add_argument("--warmup", type=int, default=3, metavar="W",
                        help="untimed iterations per size (default 3)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="element type (default float32; bfloat16 works without "
                             "ml_dtypes, as raw bits summed the way torch rounds)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="deadline of each collective (default: the transport's)")
    parser.add_argument("--small-message-bytes", type=_size, default=None, metavar="BYTES",
                        help="switch from latency-optimal to ring algorithms above this")
    parser.add_argument("--segment-bytes", type=_size, default=None, metavar="BYTES",
                        help="pipeline segment size of the ring algorithms")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the correctness check")
    parser.add_argument("--json", default=None, metavar="FILE", help="write rows as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="plot busbw against size (needs matplotlib)")
    parser.add_argument("--layout", default=None, metavar="HxR",
                        help="run the ranks on test hosts instead of loopback: H network "
                             "namespaces of R ranks each on one switch (2x2, or ranks per "
                             "host: 1,2,3); needs root")
    parser.add_argument("--rate-mbit", type=float, default=None, metavar="MBIT",
                        help="with --layout: each host's link rate, both ways (default: "
                             "unshaped)")
    parser.add_argument("--job-timeout", type=float, default=1800.0, metavar="SECONDS",
                        help="with --layout: deadline of the whole run (default 1800)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [args.op, "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--dtype", args.dtype, "--worker"]
    for flag, value in (("--sizes", args.sizes), ("--timeout", args.timeout),
                        ("--small-message-bytes", args.small_message_bytes),
                        ("--segment-bytes", args.segment_bytes), ("--json", args.json),
                        ("--plot", args.plot)):
        if value is not None:
            argv += [flag, str(value)]
    if not args.check:
        argv.append("--no-check")
    return argv


def run(args: argparse.Namespace) -> int:
    """Launch the ranks, or be one of them; returns the exit status."""
    from netdist.errors import ConfigError

    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # checked before measuring, not after minutes of benchmarking
        raise ConfigError("--plot needs matplotlib: pip install 'netdist[plot]'")
    sizes = _sizes(args)
    if args.layout is not None:
        from netdist.cli.bench_cluster import run_in_cluster

        return run_in_cluster(args, _worker_argv(args))
    if args.rate_mbit is not None:
        raise ConfigError("--rate-mbit shapes the links of --layout's hosts; add --layout")
    if args.worker or os.environ.get("NETDIST_RANK"):
        from netdist.cli.loop import run as run_loop

        return run_loop(_worker(args, sizes))
    nprocs = 2 if args.nprocs is None else args.nprocs
    if nprocs < 1 or (args.op == "p2p" and nprocs < 2):
        raise ConfigError(f"-n must be >= {2 if args.op == 'p2p' else 1}, got {nprocs}")
    from netdist.launcher import launch

    command = [sys.executable, "-m", "netdist.cli.bench", *_worker_argv(args)]
    return launch(command, nprocs, prefix_output=False)


def _sizes(args: argparse.Namespace) -> list[int]:
    from netdist.collectives.benchmark import parse_sizes
    from netdist.errors import ConfigError

    text = args.sizes or ("8,64K,1M,64M" if args.op == "p2p" else "8:64M")
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise ConfigError(f"--sizes: {exc}") from None


async def _worker(args: argparse.Namespace, sizes: list[int]) -> int:
    from netdist.cli.loop import event_loop_name
    from netdist.collectives import Group
    from netdist.collectives.benchmark import format_table, plot_rows, run_benchmark, write_json
    from netdist.errors import ConfigError
    from netdist.transport.bootstrap import init

    async with init() as transport:
        rank, n = transport.rank, transport.world_size
        start = transport.traffic()
        meta: dict[str, Any] = {"op": args.op, "world_size": n, "dtype": args.dtype,
                                "event_loop": event_loop_name(), "iters": args.iters,
                                "warmup": args.warmup}
        if args.op == "p2p":
            from netdist.transport.probe import p2p_benchmark

            if n < 2:
                raise ConfigError("bench p2p needs at least 2 ranks")
            rows: list[Any] = await p2p_benchmark(transport, sizes, args.iters,
                                                  warmup=args.warmup, timeout=args.timeout)
            if rank == 0:
                print(f"# netdist bench p2p: rank 0 <-> rank 1 of {n}, "
                      f"{meta['event_loop']}", flush=True)
                print(_p2p_table(rows), flush=True)
        else:
            settings: dict[str, Any] = {}
            if args.small_message_bytes is not None:
                settings["small_message_bytes"] = args.small_message_bytes
            if args.segment_bytes is not None:
                settings["segment_bytes"] = args.segment_bytes
            group = Group(transport, args.timeout, **settings)
            meta.update(small_message_bytes=group.small_message_bytes,
                        segment_bytes=group.segment_bytes)
            title = (f"netdist bench {args.op}: {n} ranks, {args.dtype}, "
                     f"{meta['event_loop']}, small_message_bytes={group.small_message_bytes}, "
                     f"segment_bytes={group.segment_bytes}")
            if rank == 0:
                print(format_table([], title), flush=True)

            def show(row: Any) -> None:
                print(format_table([row]).splitlines()[-1], flush=True)

            async with group:
                rows = await run_benchmark(group, args.op, sizes, iters=args.iters,
                                           warmup=args.warmup, dtype=args.dtype,
                                           timeout=args.timeout, check=args.check,
                                           on_row=show if rank == 0 else None)
        if rank == 0:
            traffic = transport.traffic() - start
            print("\n".join(f"# {line}" for line in traffic.describe().splitlines()),
                  flush=True)
            meta["traffic"] = dataclasses.asdict(traffic.total)
            if args.json:
                write_json(args.json, rows, meta)
            if args.plot and args.op != "p2p":
                plot_rows(args.plot, rows, f"netdist {args.op}, {n} ranks")
            failed = [r for r in rows
                      if not isinstance(r, dict) and r.check.startswith("FAIL")]
            if failed:
                print(f"netdist bench: {len(failed)} size(s) failed the correctness check",
                      file=sys.stderr, flush=True)
                return 1
    return 0


def _p2p_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"# {'size':>10} {'iters':>6} {'rtt med':>10} {'rtt p99':>10} {'one-way':>9}",
             f"# {'(B)':>10} {'':>6} {'(us)':>10} {'(us)':>10} {'(GB/s)':>9}"]
    for r in rows:
        lines.append(f"  {r['size']:>10} {r['iters']:>6} {r['rtt_median_us']:>10.1f} "
                     f"{r['rtt_p99_us']:>10.1f} {r['oneway_gbps']:>9.3f}")
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    """``python -m netdist.cli.bench ...``: what the launched workers run."""
    from netdist.cli.main import build_parser
    from netdist.config import parse_switch

    parser = build_parser(("bench",))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    debug = False
    try:
        debug = parse_switch(os.environ, "NETDIST_DEBUG", False)
        return run(args)
    except Exception as exc:  # noqa: BLE001 - report like netdist's main, with the rank
        from netdist.cli.main import format_error
        from netdist.errors import ConfigError, NetdistError

        if not isinstance(exc, NetdistError) or debug:
            raise
        rank = os.environ.get("NETDIST_RANK", "?")
        print(format_error(f"bench (rank {rank})", exc), file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(_main())
