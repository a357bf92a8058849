"""A blocking-API rank that all-reduces once, then (rank 0) sends itself ``SIGUSR1`` and
prints where its flight record went: ``python -m tests.trace._signal_member``."""

from __future__ import annotations

import os
import signal

import numpy as np

import netdist

with netdist.connect() as job:
    job.group.all_reduce(np.ones(4))
    if job.rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)  # handled between bytecodes, on this thread
        print(f"dumped {job.transport.target.recorder.last_dump}", flush=True)
    job.group.barrier()
