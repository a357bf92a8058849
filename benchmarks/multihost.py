"""netdist against Gloo across hosts: collectives between ranks on shaped links (issue 29).

The ranks run in a ``netdist.netlab`` cluster: one network namespace per host, all on one
switch (a Linux bridge), every host's link shaped with ``tc tbf`` to ``--rate-mbit`` in
each direction, the ranks of a host sharing it as they would a machine (and its shared
memory: ``NETDIST_HOST_ID`` is the host). A layout ``HxR`` is H hosts of R ranks.

Three columns, measured in one run and interleaved (each round runs every backend once,
the order alternating from round to round, so all see the same background load):

``gloo``           ``torch.distributed`` with backend ``gloo`` (``GLOO_SOCKET_IFNAME`` is
                   the host's interface);
``netdist-torch``  the same script with backend ``netdist`` (``import netdist.torch``);
``netdist``        netdist's own API: ``netdist.collectives.Group`` over
                   ``netdist.transport.bootstrap.init()``, timed by
                   ``netdist.collectives.benchmark.run_benchmark`` (its check runs too).

Sizes follow nccl-tests (and ``netdist bench``): the per-rank buffer of all_reduce and
broadcast, the input of reduce_scatter, the output of all_gather; float32. Each iteration
starts after a barrier and its time is the slowest rank's; a job reports the median over
its iterations and a column the median over rounds. The bound is what the links allow
across H hosts with a link of B bytes/s each way, S bytes: all_reduce 2(H-1)/H*S/B,
reduce_scatter and all_gather (H-1)/H*S/B, broadcast S/B; ``%`` is bound / time. At 2x1
that percentage is also the share of the link (busbw / B), printed as ``link%``. Sizes
within the shaper's burst (``netdist.netlab.burst_bytes``: 2 ms of traffic, 250 KB at
1 Gbit/s) pass faster than the rate, and may show more than 100%.

Targets (issue 29, 1 Gbit/s links; one PASS/MISS line each, for the netdist API and the
torch backend): all_reduce 16 and 64 MiB >= 85% of the bound at 2x2, 2x4 and 4x2, and
never slower than Gloo at any layout and size from 1 MiB up; reduce_scatter, all_gather
and broadcast 64 MiB at 2x2 >= 80% of the bound; at 2x1 >= 90% of the link (16 MiB up).

    sudo python benchmarks/multihost.py                  # 2x1,2x2,2x4,4x2 at 1 Gbit/s
    sudo python benchmarks/multihost.py --layouts 2x2 --sizes 16M --ops all_reduce --rounds 1
    sudo python benchmarks/multihost.py --rate-mbit 10000 --json out.json
    sudo python benchmarks/multihost.py --quick          # smoke test: tiny sizes, seconds

Needs root (network namespaces and tc; it says what is missing otherwise) and torch for
the two torch columns (``--backends netdist`` runs without). Every job is bounded by
``--child-timeout``; a job that fails leaves its column empty and the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1024 * 1024
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
BACKENDS = ("gloo", "netdist-torch", "netdist")
TORCH_BACKEND = {"gloo": "gloo", "netdist-torch": "netdist"}
NETDIST_COLUMNS = ("netdist", "netdist-torch")
"""The columns judged against the targets."""
TARGET_RATE_MBIT = 1000.0
ALL_REDUCE_TARGET = (0.85, (16 * MIB, 64 * MIB), ("2x2", "2x4", "4x2"))
"""all_reduce: share of the bound, sizes, layouts."""
OTHER_OPS_TARGET = (0.80, 64 * MIB, "2x2")
"""reduce_scatter, all_gather, broadcast: share of the bound, size, layout."""
LINK_TARGET = (0.90, 16 * MIB, "2x1")
"""Every op at 2x1: share of the link, from this size up."""
GLOO_FROM = MIB
"""all_reduce never slower than Gloo from this size up."""


# -- rank side --------------------------------------------------------------------------

def element_count(op: str, size: int, world_size: int) -> int:
    """float32 elements of the full buffer: ``size`` bytes, rounded down so every rank's
    share of reduce_scatter and all_gather is equal (as ``netdist bench`` does)."""
    count = max(1, size // 4)
    if op in ("reduce_scatter", "all_gather") and count % world_size:
        count = max(world_size, count - count % world_size)
    return count


def torch_worker(spec: dict[str, Any]) -> None:
    """One rank of a torch job: every op and size through ``dist.*`` with
    ``spec["backend"]``; writes this rank's times per iteration."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if spec["backend"] == "netdist":
        import netdist.torch  # noqa: F401 - registers the "netdist" backend
    dist.init_process_group(spec["backend"], init_method="env://",
                            timeout=timedelta(seconds=spec["timeout"]))
    rank, n = dist.get_rank(), dist.get_world_size()
    times: dict[str, list[float]] = {}
    for op in spec["ops"]:
        for size in spec["sizes"]:
            count = element_count(op, size, n)
            full = torch.zeros(count, dtype=torch.float32)
            shard = torch.zeros(count // n, dtype=torch.float32)
            call = {"all_reduce": lambda: dist.all_reduce(full),
                    "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
                    "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
                    "broadcast": lambda: dist.broadcast(full, 0)}[op]
            measured = []
            for i in range(spec["warmup"] + spec["iters"]):
                dist.barrier()
                started = time.perf_counter()
                call()
                if i >= spec["warmup"]:
                    measured.append(time.perf_counter() - started)
            times[f"{op}:{count * 4}"] = measured
    Path(spec["out"], f"rank_{rank}.json").write_text(json.dumps({"times": times}))
    dist.barrier()
    dist.destroy_process_group()


async def api_worker(spec: dict[str, Any]) -> None:
    """One rank of a netdist job: ``run_benchmark`` per op; rank 0 writes the medians."""
    from netdist.collectives import Group
    from netdist.collectives.benchmark import run_benchmark
    from netdist.transport.bootstrap import init

    medians: dict[str, float] = {}
    checks: dict[str, str] = {}
    async with init() as transport:
        async with Group(transport, spec["timeout"]) as group:
            for op in spec["ops"]:
                rows = await run_benchmark(group, op, spec["sizes"], iters=spec["iters"],
                                           warmup=spec["warmup"], timeout=spec["timeout"],
                                           check=spec["check"])
                for row in rows:
                    medians[f"{op}:{row.size}"] = row.time_median_us / 1e6
                    checks[f"{op}:{row.size}"] = row.check
        if transport.rank == 0:
            Path(spec["out"], "rank_0.json").write_text(
                json.dumps({"medians": medians, "checks": checks}))


def worker(spec: dict[str, Any]) -> None:
    if spec["column"] == "netdist":
        from netdist.cli.loop import run as run_loop

        run_loop(api_worker(spec))
    else:
        torch_worker(dict(spec, backend=TORCH_BACKEND[spec["column"]]))


# -- orchestration ----------------------------------------------------------------------

def run_job(cluster: Any, column: str, spec: dict[str, Any], port: int,
            timeout: float) -> dict[str, Any] | None:
    """One job of ``column`` on every rank of ``cluster``: ``{"medians": {op:size:
    seconds}, "checks": {...}}``, or None when it failed (its ranks' stderr printed)."""
    n = cluster.layout.world_size
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, column=column, out=tmp)
        spec_path = os.path.join(tmp, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        results = cluster.run(lambda rank: [sys.executable, HERE, "--worker", spec_path],
                              timeout, port=port, token=secrets.token_hex(16),
                              torch=column in TORCH_BACKEND, cwd=REPO,
                              extra={"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"})
        wanted = [Path(tmp, "rank_0.json")] if column == "netdist" else [
            Path(tmp, f"rank_{r}.json") for r in range(n)]
        if not all(p.exists() for p in wanted):
            for r in results:
                if not r.ok:
                    how = "killed" if r.killed else f"exit {r.returncode}"
                    print(f"# {column} at {cluster.layout}: rank {r.rank} {how}; stderr ends:\n"
                          f"{r.stderr[-1500:]}", file=sys.stderr, flush=True)
            return None
        ranks = [json.loads(p.read_text()) for p in wanted]
    bad = [r.rank for r in results if not r.ok]
    if bad:  # every rank wrote its results first: a failure in teardown; keep them, say so
        print(f"# {column} at {cluster.layout}: ranks {bad} failed after writing their "
              "results (teardown); results kept", file=sys.stderr, flush=True)
    if column == "netdist":
        return {"medians": ranks[0]["medians"], "checks": ranks[0]["checks"]}
    medians = {key: statistics.median(max(r["times"][key][i] for r in ranks)
                                      for i in range(len(times)))
               for key, times in ranks[0]["times"].items()}
    return {"medians": medians, "checks": {}}


def bound_seconds(op: str, hosts: int, nbytes: int, rate_mbit: float) -> float | None:
    """The least time the links allow ``op`` on ``nbytes`` across ``hosts`` hosts."""
    if hosts < 2:
        return None
    link = rate_mbit * 1e6 / 8
    factor = {"all_reduce": 2 * (hosts - 1) / hosts, "reduce_scatter": (hosts - 1) / hosts,
              "all_gather": (hosts - 1) / hosts, "broadcast": 1.0}[op]
    return factor * nbytes / link


def summarise(jobs: dict[tuple[str, str], list[dict[str, Any] | None]], layouts: list[Any],
              ops: list[str], sizes: list[int], columns: list[str],
              rate_mbit: float) -> list[dict[str, Any]]:
    """One row per (layout, op, size): each column's median over rounds, the bound and
    each column's share of it."""
    rows = []
    for layout in layouts:
        for op in ops:
            for size in sizes:
                nbytes = element_count(op, size, layout.world_size) * 4
                key = f"{op}:{nbytes}"
                row: dict[str, Any] = {"layout": str(layout), "hosts": layout.hosts,
                                       "world_size": layout.world_size, "op": op,
                                       "size": nbytes, "requested_size": size,
                                       "bound": bound_seconds(op, layout.hosts, nbytes,
                                                              rate_mbit)}
                for column in columns:
                    found = [job["medians"][key] for job in jobs[(str(layout), column)]
                             if job is not None and key in job["medians"]]
                    checks = {job["checks"].get(key) for job in jobs[(str(layout), column)]
                              if job is not None} - {None}
                    time_s = statistics.median(found) if found else None
                    row[column] = {"time": time_s, "rounds": len(found),
                                   "of_bound": (row["bound"] / time_s
                                                if time_s and row["bound"] else None),
                                   "check": ",".join(sorted(checks)) or None}
                rows.append(row)
    return rows


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _fmt_pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def print_table(rows: list[dict[str, Any]], columns: list[str], rate_mbit: float,
                rounds: int) -> None:
    from netdist.collectives.benchmark import format_size

    print(f"\n# float32; time: median over {rounds} round(s) of the per-job median "
          "(slowest rank per iteration); bound: what "
          f"{rate_mbit:g} Mbit/s links allow across the hosts; %: bound / time (over 100%: "
          "within the shaper's burst); link%: netdist's busbw / link rate (2 hosts of 1 "
          "rank)")
    head = "".join(f"{c:>15}" for c in columns) + "".join(f"{c + '%':>15}" for c in columns)
    print(f"# {'layout':>6} {'op':>15} {'size':>6}{head} {'bound':>10} {'link%':>6}  check")
    for row in rows:
        times = "".join(f"{_fmt_time(row[c]['time']):>15}" for c in columns)
        shares = "".join(f"{_fmt_pct(row[c]['of_bound']):>15}" for c in columns)
        link = (_fmt_pct(row["netdist"]["of_bound"])
                if "netdist" in columns and row["layout"] == "2x1" else "")
        check = row.get("netdist", {}).get("check") or "-"
        print(f"  {row['layout']:>6} {row['op']:>15} {format_size(row['size']):>6}{times}"
              f"{shares} {_fmt_time(row['bound']):>10} {link:>6}  {check}", flush=True)


def judge(rows: list[dict[str, Any]], columns: list[str]) -> list[dict[str, Any]]:
    """One entry per issue-29 target that was measured, per netdist column."""
    from netdist.collectives.benchmark import format_size

    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, passed: bool) -> None:
        targets.append({"name": name, "value": value, "pass": passed})

    for column in [c for c in NETDIST_COLUMNS if c in columns]:
        share, sizes, layouts = ALL_REDUCE_TARGET
        other_share, other_size, other_layout = OTHER_OPS_TARGET
        link_share, link_from, link_layout = LINK_TARGET
        for row in rows:
            got = row[column]["of_bound"]
            where = f"{row['op']} {format_size(row['size'])} at {row['layout']}"
            if row["op"] == "all_reduce" and row["size"] in sizes and row["layout"] in layouts:
                add(f"{column} {where} >= {share:.0%} of bound", got,
                    got is not None and got >= share)
            if (row["op"] != "all_reduce" and row["size"] == other_size
                    and row["layout"] == other_layout):
                add(f"{column} {where} >= {other_share:.0%} of bound", got,
                    got is not None and got >= other_share)
            if row["layout"] == link_layout and row["size"] >= link_from:
                add(f"{column} {where} >= {link_share:.0%} of the link", got,
                    got is not None and got >= link_share)
        if "gloo" in columns:
            ratios = [(row[column]["time"] / row["gloo"]["time"], row) for row in rows
                      if row["op"] == "all_reduce" and row["size"] >= GLOO_FROM
                      and row[column]["time"] and row["gloo"]["time"]]
            if ratios:
                worst, row = max(ratios, key=lambda pair: pair[0])
                add(f"{column} all_reduce never slower than gloo from "
                    f"{format_size(GLOO_FROM)} up (worst {worst:.2f}x, "
                    f"{format_size(row['size'])} at {row['layout']})", worst, worst <= 1.0)
    return targets


def _load() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f}"
    except OSError:
        return "load average unknown"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2x1,2x2,2x4,4x2",
                        help="cluster layouts HOSTSxRANKS, separated by ',' (default "
                             "2x1,2x2,2x4,4x2); uneven ones list ranks per host and are "
                             "separated by ';' (2x2;1,2,3)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="each host's link rate, both ways (default 1000; e.g. 10000)")
    parser.add_argument("--sizes", default="1M,16M,64M",
                        help="sizes in bytes, binary units (default 1M,16M,64M; 8 to 256M)")
    parser.add_argument("--ops", default=",".join(OPS), help="collectives (default: all four)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="columns to measure (default gloo,netdist-torch,netdist)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per size")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the netdist column's correctness check")
    parser.add_argument("--child-timeout", type=float, default=900.0,
                        help="deadline of each job, seconds (default 900)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: layout 2x1, sizes 4K and 64K, one round, 2 iterations")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layouts, args.sizes, args.rounds, args.iters, args.warmup = \
            "2x1", "4K,64K", 1, 2, 1
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.child_timeout <= 0 or args.rate_mbit <= 0:
        parser.error("--warmup must not be negative; --child-timeout and --rate-mbit must "
                     "be positive")
    return args


def layout_texts(text: str) -> list[str]:
    """``"2x1,2x2"`` -> both grids; ``"1,2,3"`` -> one uneven layout; ``;`` or spaces
    separate layouts of either kind (``"2x2;1,2,3"``)."""
    texts = []
    for part in text.replace(";", " ").split():
        texts.extend(part.split(",") if "x" in part.lower() else [part])
    return texts


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    from netdist.collectives.benchmark import parse_sizes
    from netdist.netlab import Cluster, ClusterLayout, netlab_missing

    try:
        layouts = [ClusterLayout.parse(t) for t in layout_texts(args.layouts)]
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        print(f"multihost.py: {exc}", file=sys.stderr)
        return 2
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    columns = [c.strip() for c in args.backends.split(",") if c.strip()]
    unknown = [x for x in ops if x not in OPS] + [c for c in columns if c not in BACKENDS]
    if unknown or not ops or not columns:
        print(f"multihost.py: unknown ops or backends {unknown} (ops: {', '.join(OPS)}; "
              f"backends: {', '.join(BACKENDS)})", file=sys.stderr)
        return 2
    missing = netlab_missing()
    if missing is not None:
        print(f"multihost.py runs its ranks in network namespaces and cannot here: {missing}",
              file=sys.stderr)
        return 2
    if any(c in TORCH_BACKEND for c in columns):
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            print("multihost.py: torch is not installed (pip install torch), and the gloo "
                  "and netdist-torch columns need it; --backends netdist runs without",
                  file=sys.stderr)
            return 2
    print(f"# multihost: layouts {', '.join(map(str, layouts))}; {args.rate_mbit:g} Mbit/s "
          f"full-duplex links; {args.rounds} round(s) of {', '.join(columns)}, order "
          f"alternating; {os.cpu_count()} cores shared by every rank ({_load()})"
          + (" (--quick: tiny sizes, the PASS/MISS lines are no evidence)" if args.quick
             else ""), flush=True)
    spec = {"ops": ops, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
            "timeout": args.child_timeout, "check": args.check}
    jobs: dict[tuple[str, str], list[dict[str, Any] | None]] = {}
    job_number = 0
    for layout in layouts:
        with Cluster.create(layout, rate_mbit=args.rate_mbit) as cluster:
            for r in range(args.rounds):
                for column in (columns if r % 2 == 0 else columns[::-1]):
                    started = time.perf_counter()
                    job_number += 1
                    job = run_job(cluster, column, spec, 29500 + 2 * job_number,
                                  args.child_timeout)
                    jobs.setdefault((str(layout), column), []).append(job)
                    print(f"# {layout} round {r + 1}/{args.rounds}: {column} "
                          f"{'done' if job else 'FAILED'} in "
                          f"{time.perf_counter() - started:.1f} s ({_load()})", flush=True)
    rows = summarise(jobs, layouts, ops, sizes, columns, args.rate_mbit)
    print_table(rows, columns, args.rate_mbit, args.rounds)
    targets = judge(rows, columns) if args.rate_mbit == TARGET_RATE_MBIT else []
    print()
    if args.rate_mbit != TARGET_RATE_MBIT:
        print(f"# the targets are set for {TARGET_RATE_MBIT:g} Mbit/s links: not judged")
    for target in targets:
        value = target["value"]
        shown = "-" if value is None else (f"{value:.2f}x" if "gloo" in target["name"]
                                           else f"{value:.0%}")
        print(f"{'PASS' if target['pass'] else 'MISS'}  {target['name']}: {shown}", flush=True)
    failed = sorted({f"{layout}/{column}" for (layout, column), runs in jobs.items()
                     for job in runs if job is None})
    bad_checks = [f"{row['layout']} {row['op']} {row['size']}" for row in rows
                  if "netdist" in columns and (row["netdist"]["check"] or "ok") != "ok"
                  and row["netdist"]["check"] != "-"]
    if failed:
        print(f"# failed jobs: {', '.join(failed)}", flush=True)
    if bad_checks:
        print(f"# netdist's correctness check failed: {', '.join(bad_checks)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "layouts": [str(x) for x in layouts], "rate_mbit": args.rate_mbit,
            "rounds": args.rounds, "iters": args.iters, "quick": args.quick,
            "columns": columns, "rows": rows, "targets": targets, "failed_jobs": failed,
            "failed_checks": bad_checks}, indent=2))
    return 1 if failed or bad_checks else 0


if __name__ == "__main__":
    sys.exit(main())
