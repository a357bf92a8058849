"""A rank of the straggler-report job in tests/trace/test_stragglers.py.

Run as ``python -m tests.trace._straggler_worker LATE_RANK LATE_SECONDS MIN_STEPS MAX_STEPS``
with the NETDIST_* variables set (``NETDIST_STRAGGLER_REPORT`` among them). A blocking
rank (``netdist.connect``: the transport on a progress thread, as a training script that
computes between collectives has it). Every step, rank LATE_RANK computes for
LATE_SECONDS (``time.sleep``: the injected lateness, the workload, not a synchronisation),
then every rank all-reduces ``[1, named]`` where ``named`` is 1 on rank 0 once its live
report names a straggler. All ranks see the same sum, so they stop at the same step: the
first one at or after MIN_STEPS where rank 0's report named someone, or MAX_STEPS. Rank 0
prints ``REPORT <rank> <late ms>`` per straggler of its report, then every rank prints
``DONE <rank> <steps>``.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np

import netdist
from netdist.progress import unwrap
from netdist.trace.straggler_monitor import straggler_report


def main(late_rank: int, late_seconds: float, min_steps: int, max_steps: int) -> int:
    with netdist.connect() as job:
        rank, transport = job.rank, unwrap(job.transport)
        steps = 0
        while steps < max_steps:
            if rank == late_rank:
                time.sleep(late_seconds)
            named = 1.0 if rank == 0 and straggler_report(transport) else 0.0
            values = np.array([1.0, named])
            job.group.all_reduce(values)
            steps += 1
            if values[0] != job.world_size:
                print(f"WRONG {rank} {values.tolist()}", flush=True)
                return 1
            if values[1] > 0 and steps >= min_steps:
                break
        if rank == 0:
            for straggler in straggler_report(transport):
                print(f"REPORT {straggler.rank} {straggler.median_late_ms:.3f}", flush=True)
        print(f"DONE {rank} {steps}", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    late, seconds, least, most = sys.argv[1:5]
    sys.exit(main(int(late), float(seconds), int(least), int(most)))
