"""A rank for the liveness tests: ``python -m tests.progress.liveness_worker MODE``.

Configuration comes from the environment (``NETDIST_*``). Rank 0 started with
coordinator port 0 prints ``COORDINATOR host:port`` once it is bound. Modes:

- ``compute SECONDS``: after one all-reduce, rank 0 computes for SECONDS in pure
  Python, then for SECONDS in NumPy kernels, between collectives; rank 1 waits in the
  next all-reduce the whole time. Both print ``DONE <sum>``.
- ``stop``: after one all-reduce both print ``READY <pid>``; rank 1 then blocks on stdin
  (the test SIGSTOPs it) while rank 0 waits in an all-reduce and prints
  ``LOST <error type>: <message>`` when the transport gives up on rank 1.
- ``interrupt``: after ``READY <pid>`` rank 0 blocks in a receive and SIGINTs itself
  once its main thread is inside it (Ctrl-C), prints ``INTERRUPTED`` and leaves (exit
  130); rank 1, waiting on rank 0, prints ``LOST ...``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
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
        if mode == "interrupt":
            return interrupted(job)
        if job.rank == 1:
            sys.stdin.readline()
            return 0
        try:
            job.group.all_reduce(total)
        except NetdistError as exc:
            say(f"LOST {type(exc).__name__}: {exc}")
            return 3
        return 0


def interrupt_when_blocked() -> None:
    """SIGINT this process (Ctrl-C) once its main thread is inside a blocking netdist
    call: polls the main thread's stack (bounded), so the signal lands in the call."""
    main = threading.main_thread().ident
    assert main is not None
    deadline = time.monotonic() + 60

    def blocked() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_filename.endswith(("progress/thread.py", "progress/handle.py")):
                return True
            frame = frame.f_back
        return False

    def watch() -> None:
        while time.monotonic() < deadline and not blocked():
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def interrupted(job: Job) -> int:
    """Rank 0 blocks in a receive nobody answers until it is interrupted (SIGINT, as
    Ctrl-C sends); rank 1 waits on rank 0 and must learn that rank 0 went away."""
    if job.rank == 0:
        try:
            interrupt_when_blocked()
            job.group.recv(1, tag=5)
        except KeyboardInterrupt as exc:
            say("INTERRUPTED")
            job.close(exc)
            return 130
        return 0
    try:
        job.group.recv(0, tag=6)
    except NetdistError as exc:
        say(f"LOST {type(exc).__name__}: {exc}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
