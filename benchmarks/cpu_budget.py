"""Where an all-reduce's time goes when ranks share cores: CPU per rank, user and kernel.

Launches ``--nprocs`` ranks on 127.0.0.1 (real processes, ``netdist.launcher``), runs
``--iters`` all-reduces of ``--size`` bytes of float32, and prints for every rank the wall
time per op and the CPU it used per op (``getrusage``: user = NumPy reductions and Python;
sys = the kernel moving bytes through loopback TCP), then the bound this puts on the
wall time when the ranks outnumber the cores:

    wall >= (sum over ranks of CPU per op) / cores

and the busbw that bound allows. With 4 ranks on 2 cores the all-reduce is CPU-bound, and
most of the CPU is the kernel's: each rank sends and receives 2 (n-1)/n of the array,
and every byte costs a copy into and out of the kernel. The same script run with
``--raw`` streams the same bytes through a ring of plain non-blocking sockets (no framing,
no reductions) and prints the kernel time per GB moved for both, so the transport's own
kernel overhead can be compared with the socket floor.

Each run measures the data paths named by ``--paths``, one after the other: ``shm`` (ranks
on one host move payloads through shared memory, the all-reduce reading the peers' arrays
directly where the kernel allows; TCP only signals), ``staged`` (shared memory copied in
and out of the segment's slots, ``NETDIST_SHM_COPY=staged``) and ``tcp``
(``NETDIST_SHM=0``), and prints the kernel's share of each rank's CPU for each.

    python benchmarks/cpu_budget.py --nprocs 4 --size 64M --iters 8
    python benchmarks/cpu_budget.py --nprocs 2 --size 64M --iters 8 --raw
    python benchmarks/cpu_budget.py --nprocs 2 --size 25M --paths shm,staged,shm,staged

Every child is bounded by ``--child-timeout``; loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _worker(spec: dict) -> None:
    import numpy as np

    from netdist.cli.loop import run
    from netdist.collectives import Group
    from netdist.transport.bootstrap import init
    from netdist.types import ReduceOp

    async def main() -> None:
        async with init() as transport:
            group = Group(transport)
            n = group.world_size
            data = np.full(spec["size"] // 4, transport.rank + 1, np.float32)
            for _ in range(2):  # warm-up: connections, scratch buffers, page faults
                await group.all_reduce(data, op=ReduceOp.MAX)
            await group.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF)
            started = time.perf_counter()
            for _ in range(spec["iters"]):  # MAX costs what SUM does and stays exact
                await group.all_reduce(data, op=ReduceOp.MAX)
            wall = (time.perf_counter() - started) / spec["iters"]
            after = resource.getrusage(resource.RUSAGE_SELF)
            expected = float(n)
            row = {"rank": transport.rank, "wall_s": wall,
                   "mode": group.local_mode.value if group.local_mode else "none",
                   "copy": group.local_copy.value if group.local_copy else "none",
                   "user_s": (after.ru_utime - before.ru_utime) / spec["iters"],
                   "sys_s": (after.ru_stime - before.ru_stime) / spec["iters"],
                   "correct": bool(data[0] == expected and data[-1] == expected)}
            rows = await group.all_gather_object(row)
            if transport.rank == 0:
                with open(spec["out"], "w", encoding="utf-8") as fh:
                    json.dump(rows, fh)

    run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--raw", action="store_true",
                        help="also measure a raw socket ring moving the same bytes")
    parser.add_argument("--paths", default="shm,tcp",
                        help="data paths to measure, in order: shm, staged, tcp")
    parser.add_argument("--child-timeout", type=float, default=600.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.worker, encoding="utf-8") as fh:
            _worker(json.load(fh))
        return 0
    if args.nprocs < 2 or args.iters < 1:
        parser.error("--nprocs must be >= 2 and --iters >= 1")
    from netdist.collectives.benchmark import parse_size
    from netdist.launcher import launch
    from netdist.transport.spin import available_cpus

    size = parse_size(args.size)
    n, cores = args.nprocs, available_cpus()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(_PATH_ENV):
        parser.error(f"--paths takes {', '.join(_PATH_ENV)}")
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"size": size, "iters": args.iters, "out": os.path.join(tmp, "rows.json")}
            spec_path = os.path.join(tmp, "spec.json")
            with open(spec_path, "w", encoding="utf-8") as fh:
                json.dump(spec, fh)
            code = launch([sys.executable, HERE, "--worker", spec_path], n,
                          timeout=args.child_timeout,
                          env={"PYTHONPATH": REPO, **_PATH_ENV[path]})
            if code != 0 or not os.path.exists(spec["out"]):
                print(f"cpu_budget: workers failed (exit {code})", file=sys.stderr)
                return 1
            with open(spec["out"], encoding="utf-8") as fh:
                rows = json.load(fh)
        if not _report(rows, path, size, n, cores, args.iters):
            return 1
    if args.raw:
        sys.path.insert(0, os.path.dirname(HERE))
        from compare_gloo import _raw_ring_ceiling

        rate, sys_per_gb = _raw_ring_ceiling(n, size=size, with_cpu=True)
        print(f"  raw socket ring, same bytes: {rate:.3f} GB/s per link; kernel "
              f"{sys_per_gb * 1e3:.0f} ms per GB moved (rank 0)")
    return 0


_PATH_ENV = {"shm": {"NETDIST_SHM": "1", "NETDIST_SHM_COPY": "single"},
             "staged": {"NETDIST_SHM": "1", "NETDIST_SHM_COPY": "staged"},
             "tcp": {"NETDIST_SHM": "0"}}
"""Data path name -> the environment its ranks run with."""


def _report(rows: list[dict], path: str, size: int, n: int, cores: int, iters: int) -> bool:
    moved_gb = 2 * 2 * (n - 1) / n * size / 1e9  # sent + received per rank per op
    print(f"all_reduce {size / 2**20:g} MiB float32, {n} ranks on {cores} CPUs, "
          f"{iters} ops (per op), data path {path} (group mode {rows[0]['mode']}, "
          f"copy {rows[0].get('copy', 'none')}):")
    print(f"  {'rank':>4} {'wall ms':>9} {'user ms':>9} {'sys ms':>9} {'CPU share':>10} "
          f"{'kernel share':>13} {'sys ms/GB moved':>16}")
    for row in rows:
        cpu = row["user_s"] + row["sys_s"]
        print(f"  {row['rank']:>4} {row['wall_s'] * 1e3:9.1f} {row['user_s'] * 1e3:9.1f} "
              f"{row['sys_s'] * 1e3:9.1f} {cpu / row['wall_s']:10.0%} "
              f"{row['sys_s'] / cpu if cpu else 0:13.0%} "
              f"{row['sys_s'] * 1e3 / moved_gb:16.0f}")
    wall = max(row["wall_s"] for row in rows)
    total_cpu = sum(row["user_s"] + row["sys_s"] for row in rows)
    total_sys = sum(row["sys_s"] for row in rows)
    busbw = 2 * (n - 1) / n * size / 1e9
    print(f"  measured busbw {busbw / wall:.3f} GB/s; all ranks together used "
          f"{total_cpu / wall:.2f} of {cores} CPUs, {total_sys / total_cpu:.0%} of it "
          "in the kernel")
    if n > cores:
        floor = total_cpu / cores
        print(f"  CPU bound: wall >= total CPU / cores = {floor * 1e3:.1f} ms -> busbw <= "
              f"{busbw / floor:.3f} GB/s; the kernel's share alone allows <= "
              f"{busbw / max(total_sys / cores, 1e-9):.3f} GB/s")
    if not all(row["correct"] for row in rows):
        print("  RESULT INCORRECT", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
