"""Bucketed (fused) all-reduce against one all-reduce per tensor, over real TCP.

A "model" of ``--tensors`` float32 gradients of 10k..100k elements each (seeded, the
same on every rank) is averaged across ``--nprocs`` local ranks, each a separate process
on 127.0.0.1 started by ``netdist.launcher.launch``:

- ``bucketed``: ``AllReduceAggregator(group, bucket_mb)`` -- the gradients are packed
  into ~``bucket_mb`` MiB buckets, all-reduced with several in flight, unpacked;
- ``bucketed, grads in buckets``: the same with the gradients stored in the buckets
  (``bucket_views``, DDP's ``gradient_as_bucket_view``): no packing or unpacking;
- ``per-tensor``: ``await group.all_reduce(g, op=MEAN)`` for each tensor in turn, as a
  naive training loop would;
- ``per-tensor, all in flight``: every tensor's all-reduce issued with ``async_op=True``
  at once, then awaited (for reference: concurrency alone, without fusion);
- ``one flat all-reduce (floor)``: one all-reduce of a single array holding all the
  bytes: the bandwidth floor no bucketing can beat, so ``per-tensor / floor`` bounds
  the speedup bucketing can show on this machine.

Each step starts after a barrier; a step's time is the slowest rank's; the median over
``--steps`` steps is reported (after one warm-up round). The methods take turns step by
step, so background load hits all of them alike.

    python benchmarks/bucketing.py                       # n=4, 200 tensors, 25 MiB buckets
    python benchmarks/bucketing.py --nprocs 4 --steps 5 --bucket-mb 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


FLOOR = "one flat all-reduce (floor)"
"""The same bytes as one preallocated array: what any bucketing scheme can at best reach."""


def _model(num_tensors: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = rng.integers(10_000, 100_001, size=num_tensors)
    return [rng.standard_normal(int(n), dtype=np.float32) for n in sizes]


async def _worker(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.collectives import Group
    from netdist.parallel.aggregators import AllReduceAggregator
    from netdist.transport.bootstrap import init
    from netdist.types import ReduceOp

    async with init() as transport:
        group = Group(transport, timeout=args.op_timeout)
        rank = group.rank
        base = _model(args.tensors, seed=1234)
        grads = [g * (rank + 1) for g in base]
        agg = AllReduceAggregator(group, bucket_mb=args.bucket_mb,
                                  max_in_flight=args.max_in_flight)

        async def bucketed() -> None:
            await agg.aggregate(grads)

        view_agg = AllReduceAggregator(group, bucket_mb=args.bucket_mb,
                                       max_in_flight=args.max_in_flight)
        views = view_agg.bucket_views(grads)
        for v, g in zip(views, grads):
            v[...] = g

        async def bucket_views() -> None:
            await view_agg.aggregate(views)

        async def per_tensor() -> None:
            for g in grads:
                await group.all_reduce(g, op=ReduceOp.MEAN)

        async def per_tensor_in_flight() -> None:
            works = [await group.all_reduce(g, op=ReduceOp.MEAN, async_op=True) for g in grads]
            for w in works:
                await w

        flat = np.concatenate(grads)

        async def one_flat() -> None:
            await group.all_reduce(flat, op=ReduceOp.MEAN)

        methods = {"bucketed": bucketed, "bucketed, grads in buckets": bucket_views,
                   "per-tensor": per_tensor,
                   "per-tensor, all in flight": per_tensor_in_flight,
                   FLOOR: one_flat}
        results: dict[str, list[float]] = {name: [] for name in methods}
        for i in range(args.steps + 1):  # the first round warms up
            for name, fn in methods.items():  # interleaved: load hits every method alike
                await group.barrier()
                start = time.perf_counter()
                await fn()
                local = np.array([time.perf_counter() - start])
                await group.all_reduce(local, op=ReduceOp.MAX)
                if i:
                    results[name].append(float(local[0]))
        # correctness: the aggregator's last output is the mean over ranks of base*(r+1)
        check = [g.copy() for g in base]
        out = await AllReduceAggregator(group, bucket_mb=args.bucket_mb).aggregate(
            [g * (rank + 1) for g in check])
        factor = sum(r + 1 for r in range(group.world_size)) / group.world_size
        ok = all(np.allclose(o, b * factor, rtol=1e-5) for o, b in zip(out, base))
        if rank == 0:
            total = sum(g.nbytes for g in grads)
            report = {
                "nprocs": group.world_size, "tensors": len(grads),
                "total_mib": total / 2**20, "bucket_mb": args.bucket_mb,
                "buckets": len(agg.buckets), "correct": ok,
                "median_s": {k: statistics.median(v) for k, v in results.items()},
                "all_s": results,
            }
            med = report["median_s"]
            print(f"{len(grads)} float32 tensors, {total / 2**20:.1f} MiB per rank, "
                  f"n={group.world_size}, {len(agg.buckets)} bucket(s) of <= "
                  f"{args.bucket_mb:g} MiB, median of {args.steps} steps:")
            for name, value in med.items():
                print(f"  {name:<27} {value * 1e3:9.1f} ms/step")
            views_name = "bucketed, grads in buckets"
            print(f"  speedup vs per-tensor: bucketed {med['per-tensor'] / med['bucketed']:.1f}x, "
                  f"grads in buckets {med['per-tensor'] / med[views_name]:.1f}x; "
                  f"vs per-tensor all in flight: "
                  f"{med['per-tensor, all in flight'] / med['bucketed']:.1f}x / "
                  f"{med['per-tensor, all in flight'] / med[views_name]:.1f}x; "
                  f"result correct: {ok}")
            print(f"  the floor (one all-reduce of all {total / 2**20:.1f} MiB, no packing) "
                  f"bounds the speedup at {med['per-tensor'] / med[FLOOR]:.1f}x; bucketed "
                  f"takes {med['bucketed'] / med[FLOOR]:.2f}x the floor, grads in buckets "
                  f"{med[views_name] / med[FLOOR]:.2f}x")
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--max-in-flight", type=int, default=4,
                        help="bucket all-reduces in flight at once (AllReduceAggregator)")
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

    cmd = [sys.executable, HERE, "--worker", "--tensors", str(args.tensors),
           "--steps", str(args.steps), "--bucket-mb", repr(args.bucket_mb),
           "--max-in-flight", str(args.max_in_flight), "--op-timeout", repr(args.op_timeout)]
    if args.json:
        cmd += ["--json", os.path.abspath(args.json)]
    return launch(cmd, args.nprocs, prefix_output=False, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
