"""A rank for the liveness tests: ``python -m tests.progress.liveness_worker MODE``.

Configuration comes from the environment (``NETDIST_*``). Rank 0 started with
coordinator port 0 prints ``COORDINATOR host:port`` once it is bound. Modes:

- ``compute SECONDS``: after one all-reduce, rank 0 computes for SECONDS in pure
  Python, then for SECONDS in NumPy kernels, between collectives; rank 1 waits in the
  next all-reduce the whole time. Both print ``DONE <sum>``.
- ``stop``: after one all-reduce both print ``READY <pid>``; rank 1 then blocks on stdin
  (the test SIGSTOPs it) while rank 0 waits in an all-reduce and prints
  ``LOST <error type>: <message>`` when the transport gives up on rank 1.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from netdist.errors import NetdistError
from netdist.progress import Job


def say(line: str) -> None:
    print(line, flush=True)


def busy_python(seconds: float) -> int:
    """Pure-Python work (holds the GIL between switch intervals) for ``seconds``."""
    end, count = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        count += sum(range(1000))
    return count


def busy_numpy(seconds: float) -> float:
    """GIL-releasing NumPy kernels for ``seconds``."""
    a = np.random.default_rng(0).standard_normal((300, 300))
    end, total = time.monotonic() + seconds, 0.0
    while time.monotonic() < end:
        total += float((a @ a).trace())
    return total


def main(argv: list[str]) -> int:
    mode = argv[0]
    job = Job.connect(on_coordinator_ready=lambda where: say(f"COORDINATOR {where[0]}:{where[1]}"))
    with job:
        total = job.group.all_reduce(np.ones(4))
        if mode == "compute":
            seconds = float(argv[1])
            if job.rank == 0:
                busy_python(seconds)
                job.group.all_reduce(total)
                busy_numpy(seconds)
                job.group.all_reduce(total)
            else:
                job.group.all_reduce(total)
                job.group.all_reduce(total)
            say(f"DONE {float(total.sum())}")
            return 0
        say(f"READY {os.getpid()}")
        if job.rank == 1:
            sys.stdin.readline()
            return 0
        try:
            job.group.all_reduce(total)
        except NetdistError as exc:
            say(f"LOST {type(exc).__name__}: {exc}")
            return 3
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
