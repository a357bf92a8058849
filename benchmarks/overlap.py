"""Bucketed all-reduce overlapped with backward (DDP style), 2 ranks over real TCP.

Each rank (a separate process on 127.0.0.1, started by ``netdist.launcher.launch``, one
BLAS thread: ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``) holds the same float32 MLP of
``--depth`` ``--width`` x ``--width`` layers and its own batch of ``--rows`` rows, sized so
that backward and the all-reduce of its gradients take about as long. The gradients live
in the aggregator's buckets (``bucket_views``). Four things take turns, step by step, in
one run (so background load hits them alike):

``compute``    forward + backward alone, no communication;
``comm``       ``aggregator.aggregate(grads)`` of the same gradients alone;
``step``       ``distributed_train_step(..., overlap=False)``: compute, then all-reduce;
``overlap``    ``distributed_train_step(..., overlap=True)``: backward in a worker thread
               reports each layer's gradients as they become final, and their buckets
               go on the wire while earlier layers still compute.

A time is the slowest rank's after a barrier; the median over ``--steps`` steps (after a
warm-up) is printed, with the ratios the issue asks for:

    overlap / max(compute, comm)    target <= 1.15 (perfect overlap: 1.0)
    step / (compute + comm)         what no overlap costs (about 1.0)

Overlap needs spare cores: while a rank computes on one thread, its event loop (and the
kernel, for loopback TCP) moves bytes on another. The script therefore also measures each
rank's CPU time (``getrusage``, user + sys, all threads) per mode and prints the floor
that CPU puts on the overlapped step when the ranks' threads outnumber the cores:

    overlap >= (sum over ranks of CPU(compute) + CPU(comm)) / cores

and how many cores the target would need. It also splits each rank's overlapped step
into its backward (longer than alone when it shares a core with the transfers) and the
communication still exposed after it. The apply step is a no-op (no optimizer), so the
four modes do the same work apart from the overlap itself.

    python benchmarks/overlap.py          # 12 x 2048^2 float32: ~0.1 s compute, ~0.1 s comm
    python benchmarks/overlap.py --width 1536 --depth 6 --bucket-mb 8 --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODES = ("compute", "comm", "step", "overlap")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _worker(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.collectives import Group
    from netdist.parallel.aggregators import AllReduceAggregator
    from netdist.train.losses import softmax_cross_entropy
    from netdist.train.nn import mlp
    from netdist.train.step import distributed_train_step
    from netdist.transport.bootstrap import init
    from netdist.types import ReduceOp

    async with init() as transport:
        group = Group(transport, timeout=args.op_timeout)
        rank, world = group.rank, group.world_size
        sizes = [args.width] * (args.depth + 1) + [args.classes]
        model = mlp(sizes, rng=np.random.default_rng(0), dtype=np.float32)
        params = model.parameters()
        agg = AllReduceAggregator(group, bucket_mb=args.bucket_mb)
        for p, view in zip(params, agg.bucket_views([p.grad for p in params])):
            p.grad = view
        rng = np.random.default_rng(1 + rank)
        x = rng.standard_normal((args.rows, args.width), dtype=np.float32)
        y = rng.integers(0, args.classes, args.rows)
        grads = [p.grad for p in params]

        backward_end = [0.0]

        def compute(ready: Any = None) -> tuple[float, list[np.ndarray]]:
            model.zero_grad()
            logits, ctx = model.forward(x)
            loss, g = softmax_cross_entropy(logits, y)
            model.backward(ctx, g, on_grad_ready=ready)
            backward_end[0] = time.perf_counter()
            return loss, grads

        def apply(averaged: list[np.ndarray]) -> None:
            pass  # no optimizer: every mode does the same work but the overlap

        async def run_compute() -> None:
            compute()

        async def run_comm() -> None:
            await agg.aggregate(grads)

        async def run_step() -> None:
            await distributed_train_step(compute, apply, agg)

        async def run_overlap() -> None:
            await distributed_train_step(compute, apply, agg, overlap=True, params=params)

        runs = {"compute": run_compute, "comm": run_comm, "step": run_step,
                "overlap": run_overlap}
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        phases: list[tuple[float, float]] = []  # overlap: (backward, exposed comm after it)
        for i in range(args.steps + 1):  # the first round warms up
            for mode in MODES:
                await group.barrier()
                c0, t0 = _cpu_seconds(), time.perf_counter()
                await runs[mode]()
                t1 = time.perf_counter()
                dt, dc = t1 - t0, _cpu_seconds() - c0
                if i and mode == "overlap":
                    phases.append((backward_end[0] - t0, t1 - backward_end[0]))
                slowest = np.array([dt])
                await group.all_reduce(slowest, op=ReduceOp.MAX)
                if i:
                    wall[mode].append(float(slowest[0]))
                    cpu[mode].append(dc)
        mine = np.array([statistics.median(cpu[m]) for m in MODES]
                        + [statistics.median(p[0] for p in phases),
                           statistics.median(p[1] for p in phases)])
        stats = np.asarray(await group.all_gather(mine)).reshape(world, len(MODES) + 2)
        if rank == 0:
            _report(args, world, sizes, sum(g.nbytes for g in grads), len(agg.buckets),
                    wall, stats[:, :len(MODES)], stats[:, len(MODES):])


def _report(args: argparse.Namespace, world: int, sizes: list[int], grad_bytes: int,
            buckets: int, wall: dict[str, list[float]], cpu: Any, phases: Any) -> None:
    med = {m: statistics.median(v) for m, v in wall.items()}
    cpu_sum = {m: float(sum(cpu[r][i] for r in range(world))) for i, m in enumerate(MODES)}
    cores = len(os.sched_getaffinity(0))
    bound = max(med["compute"], med["comm"])
    ratio_overlap = med["overlap"] / bound
    ratio_step = med["step"] / (med["compute"] + med["comm"])
    demand = cpu_sum["compute"] + cpu_sum["comm"]
    used = cpu_sum["overlap"] / med["overlap"]
    floor = demand / cores
    cores_needed = demand / (1.15 * bound)
    labels = {"compute": "compute alone (fwd+bwd)", "comm": "communication alone",
              "step": "step, no overlap", "overlap": "step, overlap"}
    print(f"{world} ranks, MLP {args.depth} x {args.width}^2 + {args.width}x{args.classes} "
          f"float32 ({grad_bytes / 2**20:.1f} MiB of gradients), {args.rows} rows per rank, "
          f"{buckets} buckets of <= {args.bucket_mb:g} MiB, one BLAS thread per rank, "
          f"{cores} cores, load average {os.getloadavg()[0]:.1f}; median of "
          f"{args.steps} interleaved steps:")
    for i, m in enumerate(MODES):
        per_rank = " + ".join(f"{cpu[r][i] * 1e3:.0f}" for r in range(world))
        print(f"  {labels[m]:<25} {med[m] * 1e3:8.1f} ms   CPU {per_rank} ms "
              f"({cpu_sum[m] / med[m]:.2f} cores)")
    print(f"  step_overlap / max(compute, comm)   = {ratio_overlap:.2f}  (target <= 1.15)")
    print(f"  step_no_overlap / (compute + comm)  = {ratio_step:.2f}")
    print(f"  overlap saved {1 - med['overlap'] / med['step']:.0%} of the step "
          f"({med['step'] * 1e3:.0f} -> {med['overlap'] * 1e3:.0f} ms)")
    split = "; ".join(f"rank {r}: backward {phases[r][0] * 1e3:.0f} ms, then "
                      f"{phases[r][1] * 1e3:.0f} ms exposed" for r in range(world))
    print(f"  inside the overlapped step ({split}); backward alone takes "
          f"{med['compute'] * 1e3:.0f} ms")
    print(f"  cores: the overlapped step kept {used:.2f} of the {cores} cores busy; compute + "
          f"comm need {demand * 1e3:.0f} ms of CPU per step over {world} ranks, so on {cores} "
          f"cores it takes >= {floor * 1e3:.0f} ms = {floor / bound:.2f} x max(compute, comm)")
    print(f"  target 1.15: that CPU must fit in 1.15 x max(compute, comm) = "
          f"{1.15 * bound * 1e3:.0f} ms, which takes >= {cores_needed:.1f} cores "
          f"(this machine: {cores})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"world": world, "sizes": sizes, "rows": args.rows,
                       "grad_bytes": grad_bytes, "buckets": buckets, "cores": cores,
                       "median_s": med, "all_s": wall, "cpu_s_per_rank": cpu.tolist(),
                       "overlap_backward_and_exposed_s": phases.tolist(),
                       "cores_used_overlap": used, "ratio_overlap": ratio_overlap,
                       "ratio_step": ratio_step, "cpu_floor_s": floor,
                       "cores_needed": cores_needed}, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12, help="width x width layers")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rows", type=int, default=32, help="batch rows per rank")
    parser.add_argument("--bucket-mb", type=float, default=16.0,
                        help="bucket size; 16 MiB puts each 2048^2 float32 layer alone")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--op-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="whole-run bound")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from netdist.cli.loop import run

        run(_worker(args))
        return 0
    from netdist.launcher import launch

    cmd = [sys.executable, HERE, "--worker", "--width", str(args.width), "--depth",
           str(args.depth), "--classes", str(args.classes), "--rows", str(args.rows),
           "--bucket-mb", repr(args.bucket_mb), "--steps", str(args.steps),
           "--op-timeout", repr(args.op_timeout)]
    if args.json:
        cmd += ["--json", os.path.abspath(args.json)]
    return launch(cmd, args.nprocs, env=ONE_THREAD, prefix_output=False,
                  timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
