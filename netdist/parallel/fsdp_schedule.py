"""When FSDP gathers parameters and reduces gradients, around each unit's compute.

``GatherReduceSchedule`` runs forward and backward over the units and issues every
collective FSDP needs, with ``async_op=True`` so the event loop moves bytes while a unit
computes:

- forward: with ``prefetch_depth = d`` the all-gathers of units ``i .. i+d`` are in
  flight while unit ``i`` computes; a unit is freed after it computed, except the last
  one when a backward follows (``keep_last``), which starts with it;
- backward: the all-gathers of units ``i .. i-d`` likewise; each unit's gradient is
  reduce-scattered into its shard (then averaged over the replicas, if any) or, when
  gradients are not sharded, all-reduced whole; one reduction stays in flight (``d > 0``)
  while the next unit's backward runs;
- step: after each unit's update, whole parameters are all-gathered again when the
  policy keeps them (``regathers_parameters``).

Every collective is issued from the calling coroutine at a point that depends only on
the unit index and ``d``, so all ranks issue them in the same order. The policy
(``ShardingPolicy``) says which of these apply; nothing here asks for a strategy by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.errors import FSDPError
from netdist.parallel.fsdp_stats import MemoryTracker, Timings
from netdist.parallel.fsdp_strategy import ShardingPolicy
from netdist.parallel.fsdp_units import ModuleView, Unit, backward_layers, forward_layers
from netdist.reduce_kernels import reduce_into
from netdist.types import ReduceOp

if TYPE_CHECKING:
    from netdist.collectives import Group

__all__ = ["GatherReduceSchedule"]


@dataclass(slots=True, eq=False)
class _GradJob:
    unit: Unit
    work: Any
    buffer: np.ndarray | None              # full-size gradient buffer being reduced
    result: np.ndarray | None              # this rank's reduced shard


class GatherReduceSchedule:
    """Issues, awaits and frees the collectives of FSDP's units (module docstring).

    ``shard_group`` carries the all-gathers and reduce-scatters, ``replica_group`` the
    gradient averaging across copies; either may be None when the policy has none.
    Buffers are allocated from ``memory``; waits are added to ``timings``.
    """

    def __init__(self, policy: ShardingPolicy, shard_group: Group | None,
                 replica_group: Group | None, *, prefetch_depth: int,
                 timeout: float | None, compute_in_thread: bool, memory: MemoryTracker,
                 view: ModuleView) -> None:
        self.policy = policy
        self.shard_group = shard_group
        self.replica_group = replica_group
        self.prefetch_depth = prefetch_depth
        self.timeout = timeout
        self.compute_in_thread = compute_in_thread
        self.memory = memory
        self.view = view
        self.timings = Timings()
        self._pending: list[Any] = []
        group = shard_group if shard_group is not None else replica_group
        self._recorder = None if group is None else group.transport.recorder

    def _span(self, name: str, unit: Unit | None = None,
              **args: Any) -> contextlib.AbstractContextManager[Any]:
        """A trace span of FSDP (``netdist.trace``) around a wait for ``unit``'s
        collective: which unit (and its layers) and how many bytes."""
        if self._recorder is None:
            return contextlib.nullcontext()
        if unit is not None:
            start, stop = unit.layer_range
            args.update(unit=unit.index, layers=f"{start}..{stop - 1}")
        return self._recorder.span("fsdp", name, **args)

    # -- parameter gathering -------------------------------------------------------------

    def _sharding(self) -> Group:
        """The shard group, where a code path only runs with more than one shard."""
        group = self.shard_group
        if group is None:
            raise FSDPError(f"FSDP ({self.policy.strategy.name}) has no shard group here "
                            "(internal state error)")
        return group

    async def issue_gather(self, unit: Unit) -> None:
        if unit.gather_work is not None or unit.layout.numel == 0:
            return
        buf = self.memory.alloc("gathered", unit.layout.padded_numel, unit.layout.np_dtype,
                                zero=False)
        unit.gather_buf = buf
        unit.gather_work = await self._sharding().all_gather(
            unit.shard, out=buf, async_op=True, timeout=self.timeout)
        self.timings.allgathers += 1
        self.timings.allgather_bytes += buf.nbytes

    async def wait_gathered(self, unit: Unit) -> None:
        if unit.layout.numel == 0:
            return
        if unit.gather_work is None:
            await self.issue_gather(unit)
        started = time.perf_counter()
        with self._span("all_gather", unit, bytes=unit.layout.padded_numel
                        * unit.layout.np_dtype.itemsize):
            await unit.gather_work
        self.timings.allgather_wait += time.perf_counter() - started
        gathered = unit.gather_buf
        if gathered is None:
            raise FSDPError(f"FSDP unit {unit.index}: all-gather finished without its "
                            "buffer (internal state error)")
        for p, view in zip(unit.params, unit.layout.views(gathered)):
            p.data = self.view.expose(view)

    def release(self, unit: Unit) -> None:
        """Free ``unit``'s gathered parameters (its ``p.data`` become placeholders)."""
        if unit.gather_buf is None and unit.gather_work is None:
            return
        for p in unit.params:
            p.data = self.view.placeholder(unit.layout.np_dtype)
        self.memory.free(unit.gather_buf)
        unit.gather_buf = None
        unit.gather_work = None

    def release_all(self, units: Sequence[Unit]) -> None:
        """Drop every gathered unit (before shards change: step, loads)."""
        for unit in units:
            if unit.gather_work is not None and not unit.gather_work.done():
                raise FSDPError("FSDP: an all-gather is still in flight; finish the "
                                "forward/backward that issued it first")
            self.release(unit)

    async def _prefetch(self, units: Sequence[Unit], indices: range) -> None:
        for j in indices:
            await self.issue_gather(units[j])

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, in a worker thread with ``compute_in_thread``; timed."""
        started = time.perf_counter()
        try:
            if self.compute_in_thread:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)
        finally:
            self.timings.compute += time.perf_counter() - started

    # -- forward / backward --------------------------------------------------------------

    async def forward(self, units: Sequence[Unit], x: Any, keep_last: bool
                      ) -> tuple[Any, list[Any]]:
        """Run the units in order; ``(output, per-unit layer contexts)``.

        With prefetch on and ``keep_last`` (a backward follows), the last unit stays
        gathered: backward starts with it, so its all-gather is not repeated (torch
        FSDP keeps the root unit the same way). It is released by backward, ``step`` or
        any load."""
        depth = self.prefetch_depth
        keep_last = keep_last and depth > 0
        gathers = self.policy.shards_parameters
        ctxs: list[Any] = []
        for i, unit in enumerate(units):
            if gathers:
                await self._prefetch(units, range(i, min(len(units), i + depth + 1)))
                await self.wait_gathered(unit)
            x, layer_ctxs = await self.compute(forward_layers, unit.layers, x)
            if gathers and not (keep_last and i == len(units) - 1):
                self.release(unit)
            ctxs.append(layer_ctxs)
        return x, ctxs

    async def backward(self, units: Sequence[Unit], ctxs: Sequence[Any], grad: Any) -> Any:
        """Back-propagate ``grad`` through the units in reverse, reducing each unit's
        gradient into ``unit.grad`` (added); returns the input gradient."""
        depth = self.prefetch_depth
        lag = 1 if depth > 0 else 0
        reducing: deque[_GradJob] = deque()
        averaging: deque[_GradJob] = deque()
        for i in range(len(units) - 1, -1, -1):
            unit = units[i]
            if self.policy.shards_parameters:
                await self._prefetch(units, range(i, max(-1, i - depth - 1), -1))
                await self.wait_gathered(unit)
            if self.policy.shards_gradients:
                grad = await self._backward_sharded(unit, ctxs[i], grad, reducing)
            else:
                grad = await self._backward_whole(unit, ctxs[i], grad, averaging)
            while len(reducing) > lag:
                await self._finish_reduce(reducing.popleft(), averaging)
            while len(averaging) > lag:
                await self._finish_average(averaging.popleft())
        while reducing:
            await self._finish_reduce(reducing.popleft(), averaging)
        while averaging:
            await self._finish_average(averaging.popleft())
        self._pending.clear()
        return grad

    async def _backward_whole(self, unit: Unit, ctxs: Any, grad: Any,
                              averaging: deque[_GradJob]) -> Any:
        """Whole gradients (not sharded): layers add into ``unit.grad``, then it is
        all-reduced over the replicas."""
        grad = await self.compute(backward_layers, unit.layers, ctxs, grad)
        if self.replica_group is not None and unit.layout.numel:
            work = await self.replica_group.all_reduce(
                unit.grad, ReduceOp.MEAN, async_op=True, timeout=self.timeout)
            self._pending.append(work)
            averaging.append(_GradJob(unit, work, None, None))
        return grad

    async def _backward_sharded(self, unit: Unit, ctxs: Any, grad: Any,
                                reducing: deque[_GradJob]) -> Any:
        """Sharded gradients: layers add into a transient whole buffer, which is
        reduce-scattered into this rank's shard."""
        layout = unit.layout
        buffer = self.memory.alloc("grad_buffers", layout.padded_numel, layout.np_dtype)
        for p, view in zip(unit.params, layout.views(buffer)):
            p.grad = self.view.expose(view)
        try:
            grad = await self.compute(backward_layers, unit.layers, ctxs, grad)
        finally:
            for p in unit.params:
                p.grad = self.view.placeholder(layout.np_dtype)
        if self.policy.shards_parameters:
            self.release(unit)
        if layout.numel == 0:
            self.memory.free(buffer)
        elif self.policy.num_shards > 1:
            result = self.memory.alloc("grad_buffers", layout.shard_numel, layout.np_dtype,
                                       zero=False)
            work = await self._sharding().reduce_scatter(
                buffer, ReduceOp.MEAN, out=result, async_op=True, timeout=self.timeout)
            self._pending.append(work)
            reducing.append(_GradJob(unit, work, buffer, result))
        else:
            reducing.append(_GradJob(unit, None, None, buffer))
        return grad

    async def _finish_reduce(self, job: _GradJob, averaging: deque[_GradJob]) -> None:
        if job.work is not None:
            started = time.perf_counter()
            with self._span("reduce_scatter", job.unit,
                            bytes=0 if job.buffer is None else job.buffer.nbytes):
                await job.work
            self.timings.reduce_wait += time.perf_counter() - started
        self.memory.free(job.buffer)
        job.buffer = None
        if self.replica_group is not None:
            if job.result is None:
                raise FSDPError(f"FSDP unit {job.unit.index}: gradient reduction finished "
                                "without a reduced shard to average")
            job.work = await self.replica_group.all_reduce(
                job.result, ReduceOp.MEAN, async_op=True, timeout=self.timeout)
            self._pending.append(job.work)
            averaging.append(job)
        else:
            self._accumulate(job)

    async def _finish_average(self, job: _GradJob) -> None:
        started = time.perf_counter()
        averaged = job.result if job.result is not None else job.unit.grad
        with self._span("all_reduce", job.unit, bytes=averaged.nbytes):
            await job.work
        self.timings.reduce_wait += time.perf_counter() - started
        if job.result is not None:
            self._accumulate(job)

    def _accumulate(self, job: _GradJob) -> None:
        result = job.result
        if result is None:
            return
        reduce_into(ReduceOp.SUM, job.unit.grad, result)  # bfloat16 rounded as torch adds
        self.memory.free(result)
        job.result = None

    # -- after the shards change ---------------------------------------------------------

    async def step(self, units: Sequence[Unit],
                   update: Callable[[Unit], Awaitable[None]]) -> None:
        """``update`` each unit's shard in order; where whole parameters are kept, issue
        each unit's all-gather right after its update and wait for all at the end."""
        regather = self.policy.regathers_parameters
        works = []
        for unit in units:
            await update(unit)
            if regather and unit.layout.numel:
                work = await self._sharding().all_gather(
                    unit.shard, out=unit.full, async_op=True, timeout=self.timeout)
                self._pending.append(work)
                works.append(work)
        waited = time.perf_counter()
        if works:
            with self._span("all_gather", phase="step", units=len(works),
                            bytes=sum(u.full.nbytes for u in units
                                      if u.full is not None and u.layout.numel)):
                for work in works:
                    await work
        self.timings.step_allgather_wait += time.perf_counter() - waited
        self._pending.clear()

    async def sync_loaded(self, units: Sequence[Unit]) -> None:
        """After shards were loaded: broadcast replica 0's shards (and optimizer state)
        to the other replicas, and rebuild kept whole parameters from the shards."""
        replicas = self.replica_group
        if replicas is not None and self.policy.replicates_shards:
            for unit in units:
                for array in [unit.shard] + list((unit.state or {}).values()):
                    if array.size:
                        await replicas.broadcast(array, 0, timeout=self.timeout)
        if self.policy.regathers_parameters:
            for unit in units:
                if unit.layout.numel:
                    await self._sharding().all_gather(
                        unit.shard, out=unit.full, timeout=self.timeout)

    async def gather_flat(self, unit: Unit, local: np.ndarray, whole: np.ndarray | None
                          ) -> tuple[np.ndarray | None, bool]:
        """``(flat, temporary)``: the unit's whole flat buffer of ``local`` shards
        (``whole`` if already held); ``temporary`` buffers are the caller's to free."""
        if unit.layout.numel == 0:
            return None, False
        if whole is not None:
            return whole, False
        if self.policy.num_shards == 1:
            return local, False
        buf = self.memory.alloc("gathered", unit.layout.padded_numel, unit.layout.np_dtype,
                                zero=False)
        try:
            await self._sharding().all_gather(local, out=buf, timeout=self.timeout)
        except BaseException:
            self.memory.free(buf)
            raise
        return buf, True

    # -- failure -------------------------------------------------------------------------

    async def abort(self, units: Sequence[Unit]) -> None:
        """Cancel every collective still in flight and free gathered and transient
        buffers (after a failure, or on close)."""
        works = [w for w in self._pending if w is not None]
        works += [u.gather_work for u in units if u.gather_work is not None]
        for work in works:
            work.cancel()
        for work in works:
            try:
                await work
            except (asyncio.CancelledError, Exception):  # cancelled here, or failed already
                pass
        self._pending.clear()
        for unit in units:
            self.release(unit)
            if self.policy.shards_gradients:
                for p in unit.params:
                    p.grad = self.view.placeholder(unit.layout.np_dtype)
        self.memory.free_category("gathered")
        self.memory.free_category("grad_buffers")
