"""Bandwidth-optimal executors: pipelined ring all-reduce / reduce-scatter / all-gather
and pipelined chain broadcast.

They all run one *pipeline*: an ordered list of sends to one neighbour and an ordered list
of receives from another, with dependencies between them taken from the pure plans in
``plan.py``. A sender task walks the sends, each waiting only for the receive it
forwards; the receiver keeps receives posted ahead (so frames land straight in their
buffers) and combines each segment as it completes. So segment ``k + 1`` is on the wire
while segment ``k`` is being reduced, and sending and receiving always overlap, which TCP
needs: a rank that only sends while its peer only sends stalls once buffers fill.

Reduce-scatter steps receive into a small scratch buffer and reduce with ``np.<op>(...,
out=)`` into place; all-gather steps receive straight into the final position of the
output (``recv(out=view)``), with no copy.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from netdist.collectives.channel import Channel
from netdist.collectives.plan import (
    RingPlan,
    chain_broadcast_plan,
    ring_all_gather_plan,
    ring_all_reduce_plan,
    ring_reduce_scatter_plan,
)
from netdist.collectives.routes import DEFAULT_PIPELINE_DEPTH
from netdist.reduce_kernels import divide_into, reduce_into
from netdist.types import ReduceOp
from netdist.reduce_kernels import combine as combine_ordered

__all__ = [
    "run_pipeline",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "chain_broadcast",
    "MAX_POSTED",
]

MAX_POSTED = 64
"""Receives a pipeline keeps posted at most."""


class _Counter:
    """A monotone progress count that coroutines can wait on."""

    __slots__ = ("value", "_event")

    def __init__(self) -> None:
        self.value = 0
        self._event = asyncio.Event()

    def advance(self) -> None:
        self.value += 1
        self._event.set()

    async def reach(self, target: int) -> None:
        while self.value < target:
            self._event.clear()
            await self._event.wait()


async def run_pipeline(
    chan: Channel,
    send_to: int,
    sends: Sequence[tuple[np.ndarray, int]],
    recv_from: int,
    recvs: Sequence[tuple[np.ndarray, int, int]],
    on_recv: Callable[[int], None] | None = None,
    max_posted: int = MAX_POSTED,
) -> None:
    """Run ordered ``sends`` to ``send_to`` and ``recvs`` from ``recv_from`` concurrently.

    ``sends[i] = (buffer, after_recv)``: send ``buffer`` once receive ``after_recv`` has
    completed and been processed (-1: at once). ``recvs[j] = (out, after_send,
    after_recv)``: post a receive into ``out`` once send ``after_send`` has completed and
    receive ``after_recv`` has been processed (scratch reuse; -1: no condition);
    ``on_recv(j)`` runs when receive ``j`` lands, in order. Receives are posted in order,
    as early as their conditions allow (at most ``max_posted`` outstanding), so frames
    land straight in ``out``. On any failure everything still pending is cancelled and
    awaited before the first error propagates.
    """
    sent = _Counter()
    received = _Counter()

    async def sender() -> None:
        for buffer, after in sends:
            if after >= received.value:
                await received.reach(after + 1)
            await chan.send(send_to, buffer)
            sent.advance()

    async def receiver() -> None:
        pending: deque[asyncio.Future[np.ndarray]] = deque()
        posted = 0
        total = len(recvs)
        try:
            for done in range(total):
                while posted < total and posted - done < max_posted:
                    out, after_send, after_recv = recvs[posted]
                    if after_recv >= done:
                        break  # its scratch slot is still being read
                    if after_send >= sent.value:
                        if posted > done:
                            break
                        await sent.reach(after_send + 1)
                    pending.append(asyncio.ensure_future(chan.recv(recv_from, out)))
                    posted += 1
                await pending.popleft()
                if on_recv is not None:
                    on_recv(done)
                received.advance()
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    if not recvs:
        await sender()
        return
    if not sends:
        await receiver()
        return
    receiving = asyncio.ensure_future(receiver())  # first: post before our first send
    sending = asyncio.ensure_future(sender())
    try:
        done, _ = await asyncio.wait((sending, receiving), return_when=asyncio.FIRST_EXCEPTION)
        for task in (sending, receiving):
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await sending
        await receiving
    finally:
        for task in (sending, receiving):
            if not task.done():
                task.cancel()
        await asyncio.gather(sending, receiving, return_exceptions=True)


def _ring_sends(plan: RingPlan, flat: np.ndarray) -> list[tuple[np.ndarray, int]]:
    return [(flat[s.start:s.stop], s.after_recv) for s in plan.sends]


async def ring_all_reduce(chan: Channel, flat: np.ndarray, op: ReduceOp, segment: int,
                          depth: int = DEFAULT_PIPELINE_DEPTH, divisor: int | None = None) -> None:
    """Ring reduce-scatter then ring all-gather of the 1-D ``flat``, in place.

    Reduce-scatter segments land in ``depth`` rotating scratch segments (from the
    group's scratch pool) and are reduced into place; all-gather segments land in place.
    ``divisor`` (``MEAN``'s ``n``) divides each segment of this rank's own chunk right
    after its last reduction, while it is still in cache, so the all-gather spreads the
    means and nobody makes a pass over the whole array afterwards (the same division,
    so the same bits, as dividing the whole sum).
    """
    n = chan.world_size
    plan = chan.plan(ring_all_reduce_plan, chan.rank, n, flat.size, segment)
    longest = max((r.stop - r.start for r in plan.recvs if r.reduce), default=0)
    with chan.scratch(depth * longest * flat.itemsize) as raw:
        pool = raw[:depth * longest * flat.itemsize].view(flat.dtype)
        recvs: list[tuple[np.ndarray, int, int]] = []
        for j, r in enumerate(plan.recvs):
            if r.reduce:
                slot = (j % depth) * longest
                recvs.append((pool[slot:slot + r.stop - r.start], -1, j - depth))
            else:
                recvs.append((flat[r.start:r.stop], -1, -1))
        plan_recvs = plan.recvs
        last_reduce_step = n - 2

        def combine(j: int) -> None:
            r = plan_recvs[j]
            if r.reduce:
                target = flat[r.start:r.stop]
                reduce_into(op, target, recvs[j][0])
                if divisor is not None and r.step == last_reduce_step:
                    divide_into(target, divisor)

        await run_pipeline(chan, plan.send_to, _ring_sends(plan, flat), plan.recv_from,
                           recvs, combine)


async def ring_reduce_scatter(chan: Channel, flat: np.ndarray, op: ReduceOp,
                              out: np.ndarray, segment: int,
                              chunks: tuple[tuple[int, int], ...] | None = None) -> None:
    """Ring reduce-scatter of the 1-D ``flat`` into ``out`` (this rank's chunk).

    ``flat`` is left unchanged: partial sums travel through a two-slot scratch area (one
    slot per step parity), and the last step lands in ``out`` and is reduced there.
    ``chunks`` are the ranks' chunks of ``flat`` (default ``chunk_bounds``).
    """
    n = chan.world_size
    if n == 1:
        out[...] = flat
        return
    plan = chan.plan(ring_reduce_scatter_plan, chan.rank, n, flat.size, segment, chunks)
    longest = max(b - a for a, b in plan.chunks)
    with chan.scratch(2 * longest * flat.itemsize) as raw:
        area = raw[:2 * longest * flat.itemsize].view(flat.dtype)
        slots = (area[:longest], area[longest:])
        last = n - 2
        chunks = plan.chunks
        own_start = chunks[chan.rank][0]

        def where(step: int, chunk: int, start: int, stop: int) -> np.ndarray:
            if step == last:
                return out[start - own_start:stop - own_start]
            c0 = chunks[chunk][0]
            return slots[step % 2][start - c0:stop - c0]

        sends: list[tuple[np.ndarray, int]] = []
        for s in plan.sends:
            if s.step == 0:
                sends.append((flat[s.start:s.stop], -1))
            else:
                sends.append((where(s.step - 1, s.chunk, s.start, s.stop), s.after_recv))
        recvs = [(where(r.step, r.chunk, r.start, r.stop), r.slot_after_send, -1)
                 for r in plan.recvs]
        plan_recvs = plan.recvs

        def combine(j: int) -> None:
            r = plan_recvs[j]
            buffer = recvs[j][0]
            combine_ordered(op, buffer, flat[r.start:r.stop], buffer)

        await run_pipeline(chan, plan.send_to, sends, plan.recv_from, recvs, combine)


async def ring_all_gather(chan: Channel, out_flat: np.ndarray,
                          chunks: tuple[tuple[int, int], ...], segment: int,
                          on_segment: Callable[[int, int], None] | None = None) -> None:
    """Ring all-gather into the 1-D ``out_flat``; this rank's chunk must already be there.

    Every incoming segment is received straight into its final place;
    ``on_segment(start, stop)`` runs as each one lands (a two-level gather passes it on).
    """
    plan = chan.plan(ring_all_gather_plan, chan.rank, chan.world_size, chunks, segment)
    recvs = [(out_flat[r.start:r.stop], -1, -1) for r in plan.recvs]
    await run_pipeline(chan, plan.send_to, _ring_sends(plan, out_flat), plan.recv_from,
                       recvs, _landed(on_segment, [(r.start, r.stop) for r in plan.recvs]))


async def chain_broadcast(chan: Channel, flat: np.ndarray, root: int, segment: int,
                          on_segment: Callable[[int, int], None] | None = None) -> None:
    """Pipelined chain broadcast of the 1-D ``flat`` from group rank ``root``, in place;
    ``on_segment(start, stop)`` runs as each segment lands (not on the root)."""
    plan = chan.plan(chain_broadcast_plan, chan.rank, chan.world_size, root, flat.size,
                     segment)
    relay = plan.recv_from >= 0
    sends = ([] if plan.send_to < 0 else
             [(flat[a:b], k if relay else -1) for k, (a, b) in enumerate(plan.segments)])
    recvs = ([] if not relay else [(flat[a:b], -1, -1) for a, b in plan.segments])
    await run_pipeline(chan, plan.send_to, sends, plan.recv_from, recvs,
                       _landed(on_segment, plan.segments))


def _landed(on_segment: Callable[[int, int], None] | None,
            bounds: Sequence[tuple[int, int]]) -> Callable[[int], None] | None:
    """``run_pipeline``'s ``on_recv`` calling ``on_segment`` with receive ``j``'s bounds."""
    if on_segment is None:
        return None

    def on_recv(j: int) -> None:
        on_segment(*bounds[j])

    return on_recv
