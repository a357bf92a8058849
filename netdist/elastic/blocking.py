"""The blocking elastic API: the same ``ElasticJob`` driven from a synchronous loop.

The job runs on a ``ProgressThread``: between steps and while the step function
computes, that thread keeps the epoch's heartbeats going and answers the endpoint (a
joiner asking in, a survivor asking for the next agreement). The step function runs on
the caller's thread and calls ``ctx.all_reduce`` as a plain blocking call::

    with netdist.elastic.connect(state, sampler=sampler) as job:
        while job.step < steps:
            job.run_step(step_fn)            # step_fn(ctx) -> None

One implementation of the protocol: every call here submits ``ElasticJob``'s coroutines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import CollectiveMismatchError
from netdist.progress.thread import ProgressThread
from netdist.types import ReduceOp

from netdist.elastic.config import ElasticConfig
from netdist.elastic.job import (
    MEMBERSHIP_ERRORS,
    ElasticJob,
    StepContext,
    StepDiscarded,
    StepReport,
)
from netdist.elastic.sampler import ElasticSampler
from netdist.elastic.state import ElasticState

__all__ = ["BlockingElasticJob", "BlockingStepContext", "connect"]


@dataclass
class BlockingStepContext:
    """``StepContext`` for a synchronous step function."""

    inner: StepContext
    thread: ProgressThread

    @property
    def rank(self) -> int:
        """This member's rank in the epoch."""
        return self.inner.rank

    @property
    def world_size(self) -> int:
        """Members in the epoch."""
        return self.inner.world_size

    @property
    def step(self) -> int:
        """The step being attempted."""
        return self.inner.step

    @property
    def epoch(self) -> int:
        """The epoch of this attempt."""
        return self.inner.epoch

    @property
    def batch(self) -> np.ndarray | None:
        """This member's sample ids."""
        return self.inner.batch

    @property
    def global_count(self) -> int:
        """Samples of the whole step (of the members that contributed, after a resume)."""
        return self.inner.global_count

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        """All-reduce on the epoch's group (blocking; a failure retries the step)."""
        return self.thread.run(self.inner.all_reduce(array, op))

    def on_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` only when the step commits."""
        self.inner.on_commit(action)


class BlockingElasticJob:
    """A blocking handle on an ``ElasticJob`` running on its own progress thread."""

    def __init__(self, job: ElasticJob, thread: ProgressThread) -> None:
        self.job = job
        self.thread = thread

    @property
    def step(self) -> int:
        """Steps committed."""
        return self.job.step

    @property
    def epoch(self) -> int:
        """The current membership's number."""
        return self.job.epoch

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Members in the current epoch."""
        return self.job.world_size

    def run_step(self, fn: Callable[[BlockingStepContext], None]) -> StepReport:
        """``ElasticJob.run_step`` with a synchronous ``fn``."""
        attempts = 0
        while True:
            attempts += 1
            ctx = BlockingStepContext(self.thread.run(self.job.prepare_step()), self.thread)
            try:
                fn(ctx)
            except StepDiscarded:
                continue
            except MEMBERSHIP_ERRORS as exc:
                if isinstance(exc, CollectiveMismatchError):
                    raise
                self.thread.run(self.job.epoch_failed(exc))
                continue
            if self.thread.run(self.job.finish_step(ctx.inner)):
                return StepReport(self.job.step - 1, self.job.epoch, ctx.world_size,
                                  attempts, 0.0)

    def close(self) -> None:
        """Leave the job and stop the progress thread; idempotent."""
        try:
            if self.thread.running:
                self.thread.run(self.job.aclose())
        finally:
            self.thread.close()

    def __enter__(self) -> BlockingElasticJob:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def connect(state: ElasticState, *, sampler: ElasticSampler | None = None,
            config: ElasticConfig | None = None) -> BlockingElasticJob:
    """Join the elastic job this process belongs to (``ElasticConfig.from_env()`` unless
    ``config`` is given), on a new progress thread; blocks until it is a member."""
    config = ElasticConfig.from_env() if config is None else config
    thread = ProgressThread(name=f"netdist-elastic-{config.slot}").start()
    try:
        job = thread.run(_start(config, state, sampler))
    except BaseException:
        thread.close()
        raise
    return BlockingElasticJob(job, thread)


async def _start(config: ElasticConfig, state: ElasticState,
                 sampler: ElasticSampler | None) -> ElasticJob:
    return await ElasticJob.start(config, state, sampler=sampler)
