"""Helpers: n blocking ``Job``s in one process, each joined from its own thread over TCP.

Drive them with ``tests.ranks.on_every_rank`` (one thread per rank).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
import threading
from collections.abc import Iterator
from typing import Any

from netdist.config import DistributedConfig
from netdist.progress import Job

JOIN_SECONDS = 60.0
"""Outer bound on joining and on each rank's test body."""


def progress_threads() -> list[threading.Thread]:
    """The progress threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("netdist-progress")]


def connect_jobs(n: int, **overrides: Any) -> list[Job]:
    """Connect ``n`` Jobs over 127.0.0.1 (rank 0's coordinator on a free port)."""
    settings: dict[str, Any] = {
        "job_id": f"blocking-{secrets.token_hex(4)}", "token": secrets.token_hex(16),
        "coordinator": ("127.0.0.1", 0), "listen_host": "127.0.0.1",
        "advertise_addr": "127.0.0.1", "timeout": 30.0}
    settings.update(overrides)
    address: concurrent.futures.Future[tuple[str, int]] = concurrent.futures.Future()

    def on_ready(where: tuple[str, int]) -> None:
        if not address.done():
            address.set_result(where)

    def join(rank: int) -> Job:
        config = DistributedConfig(rank=rank, world_size=n, **settings)
        if rank == 0:
            return Job.connect(config, on_coordinator_ready=on_ready)
        return Job.connect(config.replace(coordinator=address.result(JOIN_SECONDS)))

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(join, rank) for rank in range(n)]
        done, _ = concurrent.futures.wait(futures, timeout=JOIN_SECONDS)
    jobs = [f.result() for f in futures if f in done and f.exception() is None]
    if len(jobs) != n:
        for job in jobs:
            job.close()
        errors = [f.exception() for f in futures if f in done and f.exception() is not None]
        raise errors[0] if errors else TimeoutError(f"{n} jobs did not join in time")
    return jobs


@contextlib.contextmanager
def jobs_of(n: int, **overrides: Any) -> Iterator[list[Job]]:
    """``connect_jobs`` as a context manager that closes every job."""
    jobs = connect_jobs(n, **overrides)
    try:
        yield jobs
    finally:
        for job in jobs:
            job.close()
