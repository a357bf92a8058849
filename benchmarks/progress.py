"""The cost of the thread hop: the blocking API against the asyncio API, same transport.

Two rank processes (``netdist.launcher.launch``, real TCP on 127.0.0.1) each join with
``netdist.connect()``, so the transport runs on the rank's progress thread. For each size
the two ways of calling the same all-reduce take turns, trial by trial:

``blocking``  ``job.group.all_reduce(x)`` from the main thread: every call hops to the
              progress thread and back (submit, wake the loop, run, wake the caller);
``asyncio``   the same collective awaited by a coroutine already running on the
              progress loop (``job.run(loop_of_calls())``): the asyncio API's cost, no hop.

Printed per size: median latency per call (small sizes) or bus bandwidth (large), and the
ratio blocking / asyncio. Targets (issue 13): 8 B at most 1.3x; 64 MiB within 5%.

Run::

    python3 benchmarks/progress.py
    python3 benchmarks/progress.py --sizes 8,1M,64M --trials 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netdist.collectives.benchmark import parse_size  # noqa: E402
from netdist.collectives import Group  # noqa: E402


def calls_for(nbytes: int) -> int:
    """Calls per trial: enough to time small messages, few for large ones."""
    return max(3, min(2000, (256 << 20) // max(nbytes, 1) // 16))


async def asyncio_calls(group: Group, data: np.ndarray, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await group.all_reduce(data, op="max")
    return (time.perf_counter() - start) / calls


def worker(spec: dict[str, Any], out_dir: str) -> None:
    import netdist

    with netdist.connect() as job:
        group: Group = job.group.target
        rows = []
        for nbytes in spec["sizes"]:
            data = np.ones(max(1, nbytes // 4), np.float32)
            calls = calls_for(nbytes)
            job.group.all_reduce(data)  # warm-up: plans, scratch, connections
            job.run(asyncio_calls(group, data, 2))
            blocking, direct = [], []
            for _ in range(spec["trials"]):
                job.group.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    job.group.all_reduce(data, op="max")
                blocking.append((time.perf_counter() - start) / calls)
                job.group.barrier()
                direct.append(job.run(asyncio_calls(group, data, calls)))
            rows.append({"nbytes": data.nbytes, "calls": calls,
                         "blocking": statistics.median(blocking),
                         "asyncio": statistics.median(direct)})
        Path(out_dir, f"rank_{job.rank}.json").write_text(json.dumps(rows))


def main() -> None:
    from netdist.launcher import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,64K,1M,64M",
                        help="comma-separated message sizes (8, 64K, 1M, 64M, ...)")
    parser.add_argument("--trials", type=int, default=7, help="alternating trials per size")
    args = parser.parse_args()
    spec = {"sizes": [parse_size(s) for s in args.sizes.split(",")], "trials": args.trials}
    with tempfile.TemporaryDirectory() as out_dir:
        code = launch([sys.executable, __file__, "_worker", json.dumps(spec), out_dir],
                      nprocs=2, timeout=1800,
                      env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        if code != 0:
            raise SystemExit(f"workers failed with exit code {code}")
        per_rank = [json.loads(Path(out_dir, f"rank_{r}.json").read_text()) for r in range(2)]
    print("progress thread hop: 2 ranks over TCP on 127.0.0.1, all_reduce float32, "
          f"median of {args.trials} alternating trials (slowest rank)")
    print(f"{'size':>10} {'calls':>6} {'blocking':>12} {'asyncio':>12} {'ratio':>7}")
    for index, row in enumerate(per_rank[0]):
        blocking = max(r[index]["blocking"] for r in per_rank)
        direct = max(r[index]["asyncio"] for r in per_rank)
        nbytes = row["nbytes"]
        if nbytes >= 1 << 20:
            fmt = lambda t: f"{nbytes / t / 1e9:8.3f} GB/s"  # noqa: E731 - n=2 busbw
        else:
            fmt = lambda t: f"{t * 1e6:9.1f} us"  # noqa: E731
        print(f"{nbytes:>10} {row['calls']:>6} {fmt(blocking):>12} {fmt(direct):>12} "
              f"{blocking / direct:6.2f}x")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
