"""Servers co-located with workers: every rank trains, the first ``S`` ranks also serve.

``ColocatedPS`` runs a ``PSServer`` task for this rank's shard (on ranks ``0..S-1``)
next to the rank's ``PSClient``; the two talk through a shared ``Loopback`` because a
transport does not send to itself. This is the deployment to use when every process of
a job runs the same training script (``netdist launch``, ``netdist demo``); use dedicated
``netdist ps-server`` ranks when servers should not compete with training for CPU.

::

    async with ColocatedPS(group, num_servers=2) as ps:
        params = await ps.init(arrays, optimizer=SGDConfig(lr=0.05, momentum=0.9))
        for batch in data:
            params = await ps.step(grads_of(params, batch))
    # leaving the block: this worker is done; a server rank also waits for the others

Parameters, gradients and ``out=`` may be CPU torch tensors, bfloat16 included, exactly
as for ``PSClient``; this rank's server keeps bfloat16 parameters as a float32 master copy
(``netdist.ps.shard.ServerShard``). In a torch loop, ``ServerOptimizerAggregator(ps,
optimizer=...)`` with ``netdist.torch.gradient_sync.GradientSync`` does the pushing and pulling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np

from netdist.errors import NetdistError, ParameterServerError
from netdist.optim import OptimizerConfig
from netdist.collectives.tags import TagRange
from netdist.ps._link import GroupLike, Loopback, WorkerSession, reserve_ps_tags
from netdist.ps.client import PSClient, Tensors
from netdist.ps.placement import DEFAULT_BIGARRAY_BOUND
from netdist.ps.protocol import SHARDED_OWNER
from netdist.ps.server import PSServer, ServerReport
from netdist.transport.base import Transport

__all__ = ["ColocatedPS"]

T = TypeVar("T")


class ColocatedPS(WorkerSession):
    """A worker on every rank plus a server shard on ranks ``0 .. num_servers-1``.

    Same calls as ``PSClient`` (``init``, ``push``, ``pull``, ``step``, ``close``). If
    this rank's server fails, the pending call raises its error at once.
    """

    def __init__(self, group: GroupLike | Transport, *, num_servers: int,
                 timeout: float | None = None, tags: TagRange | None = None) -> None:
        rank = group.rank
        tags = reserve_ps_tags(group, SHARDED_OWNER, tags)  # one range: server and client
        self._loopback = Loopback(rank)
        self.server: PSServer | None = None
        if 0 <= rank < num_servers:
            self.server = PSServer(group, num_servers=num_servers, timeout=timeout,
                                   tags=tags, colocated=True, loopback=self._loopback)
        self.client = PSClient(group, num_servers=num_servers, timeout=timeout,
                               tags=tags, colocated=True, loopback=self._loopback)
        self.report: ServerReport | None = None
        """This rank's server report once ``close`` has returned (server ranks only)."""
        self._server_task: asyncio.Task[ServerReport] | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self.client.rank

    @property
    def is_server(self) -> bool:
        return self.server is not None

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    async def init(self, params: Tensors, *, optimizer: OptimizerConfig,
                   max_staleness: int | None = 0,
                   bigarray_bound: int = DEFAULT_BIGARRAY_BOUND) -> list[np.ndarray]:
        """Start this rank's server (if any) and ``PSClient.init``."""
        if self.server is not None and self._server_task is None:
            self._server_task = asyncio.get_running_loop().create_task(self.server.run())
        return await self._guard(self.client.init(
            params, optimizer=optimizer, max_staleness=max_staleness,
            bigarray_bound=bigarray_bound))

    async def push(self, grads: Tensors) -> None:
        await self._guard(self.client.push(grads))

    async def pull(self, *, out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        return await self._guard(self.client.pull(out=out))

    async def step(self, grads: Tensors, *,
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        return await self._guard(self.client.step(grads, out=out))

    async def close(self) -> ServerReport | None:
        """This worker is done; on a server rank, wait until every worker is done.

        Idempotent. Returns this rank's ``ServerReport`` (None on pure worker ranks).
        """
        if self._closed:
            return self.report
        self._closed = True
        aborted = self.client.aborted  # a failed call already told the servers
        try:
            await self.client.close()
        finally:
            await self._finish_server(expect_error=aborted)
        return self.report

    async def abort(self, reason: str) -> None:
        """Tell every server this worker failed, then wind down this rank's server."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.client.abort(reason)
        finally:
            await self._finish_server(expect_error=True)

    async def _finish_server(self, *, expect_error: bool) -> None:
        task = self._server_task
        if task is None:
            return
        try:
            self.report = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        except NetdistError:
            if not expect_error:
                raise

    async def _guard(self, call: Awaitable[T]) -> T:
        """Await ``call``; if this rank's server dies first, raise the server's error."""
        task = self._server_task
        op: asyncio.Future[T] = asyncio.ensure_future(call)
        if task is None:
            return await op
        try:
            racers: set[asyncio.Future[Any]] = {op, task}
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            if op.done() or not task.done():
                return await op
            error = task.exception() if not task.cancelled() else None
            if error is None:
                raise ParameterServerError(f"the parameter server on rank {self.rank} "
                                           "stopped while this worker still needed it")
            raise ParameterServerError(f"the parameter server on rank {self.rank} "
                                       f"failed: {error}") from error
        finally:
            if not op.done():
                op.cancel()
                await asyncio.gather(op, return_exceptions=True)
