"""Small all-reduces among the ranks of one host through shared memory (``HostLane``).

Over TCP an 8-byte all-reduce costs, on every rank, a message out, a message in and an
event-loop wake-up; on a virtual machine the wake-ups alone cost more than everything
else netdist does for the call. MPI libraries pass small messages between the ranks of
one host through shared memory and poll for them; the lane does the same for a group's
all-reduces of up to ``LANE_BYTES`` when every rank of the group is on this host.

Layout of the lane's segment (``L`` ranks): one control line per rank, holding the last
round it published (``seq``), the round it sleeps for (``armed``) and, per round parity
and peer, whether it woke that peer (``woke``); and one slot per rank and round parity
(a header naming the bytes and dtype, then the payload).

Round ``k`` of a rank (every rank runs the group's small all-reduces in issue order, so
round ``k`` is the same call everywhere):

1. copy the input into its parity-``k % 2`` slot and store ``seq = k`` (publish);
   after a fence, read every peer's ``armed``, record in ``woke`` whether it is ``k``,
   and send each such peer a TCP wake-up;
2. poll the peers' ``seq`` until all reach ``k``, for at most the transport's spin
   budget; then store ``armed = k`` and, after a fence, sleep on the TCP wake-up of each
   peer still behind (below);
3. fold every slot in rank order (lowest first) into the array, so every rank gets the
   same bits.

Why two parities suffice: a rank writes its parity-``p`` slot (and ``woke`` entries) again
in round ``k + 2`` only after every peer published ``k + 1``, which each does after it
has finished reading round ``k``.

Why no wake-up is lost or left unreceived: publishing and arming are each followed by a
full fence before the rank reads the other's word (Dekker's pattern), so of a rank that
arms for ``k`` and a peer that publishes ``k``, at least one sees the other's store. A
sleeper that still sees the peer behind after arming knows the peer will see the arming
and send a wake-up, so it receives one. A sleeper that sees the peer has published cannot
tell whether the peer saw the arming; the peer records its decision in ``woke`` right
after making it, so the sleeper waits for that record (a few instructions away) and
receives a wake-up only if one was sent. Every send is thus matched by one receive.

Memory order: x86-64 keeps a core's stores in order and its loads in order (TSO), so a
rank that sees ``seq = k`` also sees the slot written before it; the only reordering, a
load passing an earlier store, is what the fences rule out. A fence is an uncontended
``threading.Lock`` acquire and release, a locked compare-and-swap on Linux (a full
barrier on x86). Weaker-ordered processors get no lane: their groups use TCP.

Waits stay bounded as everywhere else: a sleep is a transport ``recv`` under the
collective's deadline, so a peer that is lost or never arrives fails the call as it
would over TCP (``PeerLostError``; ``NetdistTimeoutError`` naming the rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError
from netdist.collectives.host.arena import agree_on_segment, create_or_attach, host_layout
from netdist.collectives.host.layout import LocalMode
from netdist.collectives.host.segments import SharedSegment
from netdist.collectives.host.turns import TurnQueue
from netdist.collectives.routes import LANE_BYTES
from netdist.errors import SharedMemoryError
from netdist.transport.mailbox import byte_view
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp, dtype_to_wire

__all__ = ["HostLane", "LaneRound", "LanePath", "LANE_BYTES", "SUB_LANE_WAKE", "lane_supported",
           "open_host_lane"]

# LANE_BYTES, the largest all-reduce the lane carries, is the planner's (``routes``)

SUB_LANE_WAKE = 15
"""Sub-tag of the lane's TCP wake-ups (``arena.SUB_TAGS`` holds the segment's)."""

WOKEN_SPIN_SECONDS = 50e-6
"""How long a sleeper polls for a peer's ``woke`` record before yielding to the loop
between polls (the peer is a few instructions from writing it, unless descheduled)."""

_HEADER = 64
"""Slot header: payload bytes (u64) and the dtype's ``str`` (``_DTYPE_CHARS``, ASCII)."""
_DTYPE_CHARS = 16
_SIGNAL = b"\x01"


def lane_supported() -> bool:
    """True where the lane's memory-order argument holds (x86-64; module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _control_bytes(ranks: int) -> int:
    """One rank's control line: seq, armed, woke[2][ranks] (u64 each), cache-aligned."""
    return -(-8 * (2 + 2 * ranks) // 64) * 64


def lane_segment_bytes(ranks: int) -> int:
    """Data bytes of a lane segment for ``ranks`` ranks."""
    return ranks * _control_bytes(ranks) + 2 * ranks * (_HEADER + LANE_BYTES)


@dataclass
class LaneRound:
    """One all-reduce in flight on the lane (``HostLane.begin``)."""

    k: int
    parity: int
    flat: np.ndarray
    op: ReduceOp
    asleep: list[int]
    """Peers that were asleep for this round when it was published: they get a wake-up."""
    behind: list[int]
    """Peers that had not published this round when polling ended."""

    @property
    def settled(self) -> bool:
        """Nothing left to wait for or send: ``HostLane.finish`` completes the round."""
        return not self.asleep and not self.behind


class HostLane:
    """The lane's segment, mapped by one rank of a group whose ranks all share a host."""

    def __init__(self, segment: SharedSegment, ranks: int, rank: int,
                 spin_seconds: float) -> None:
        if not 2 <= ranks or not 0 <= rank < ranks:
            raise ValueError(f"a lane needs 2 or more ranks and a rank among them, got "
                             f"rank {rank} of {ranks}")
        self.segment = segment
        self.ranks = ranks
        self.rank = rank
        self.spin_seconds = spin_seconds
        """How long a round polls its peers before sleeping on TCP (0: never polls)."""
        self._peers = tuple(p for p in range(ranks) if p != rank)
        words = _control_bytes(ranks) // 8
        control = segment.array(0, ranks * words * 8).view(np.uint64).reshape(ranks, words)
        self._seq = control[:, 0]
        self._armed = control[:, 1]
        self._woke = control[:, 2:2 + 2 * ranks].reshape(ranks, 2, ranks)
        """``_woke[publisher, parity, sleeper]``: ``round << 1 | sent``."""
        slots = segment.array(ranks * words * 8, 2 * ranks * (_HEADER + LANE_BYTES))
        slots = slots.reshape(2, ranks, _HEADER + LANE_BYTES)
        self._nbytes = slots[:, :, :8].view(np.uint64)[:, :, 0]
        self._dtypes = slots[:, :, 8:8 + _DTYPE_CHARS]
        self._payloads = slots[:, :, _HEADER:]
        self._round = int(self._seq[rank])
        self._fence_lock = threading.Lock()
        self._codes: dict[np.dtype, np.ndarray] = {}

    def _code(self, dtype: np.dtype) -> np.ndarray:
        """``dtype``'s header field (cached: one per dtype the group reduces)."""
        code = self._codes.get(dtype)
        if code is None:
            code = self._codes[dtype] = np.frombuffer(
                dtype.str.encode("ascii").ljust(_DTYPE_CHARS, b"\0"), np.uint8)
        return code

    def close(self) -> None:
        self.segment.close()

    def _fence(self) -> None:
        """A full memory barrier: an uncontended lock's compare-and-swap (x86)."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    async def all_reduce(self, chan: Channel, flat: np.ndarray, op: ReduceOp) -> None:
        """Reduce the 1-D ``flat`` (at most ``LANE_BYTES``) over the group, in place; the
        caller applies ``MEAN``'s division."""
        await self.complete(chan, self.begin(flat, op, chan.op))

    def begin(self, flat: np.ndarray, op: ReduceOp, what: str) -> LaneRound:
        """Steps 1 and 2 without waiting: publish ``flat`` as the next round, decide which
        sleeping peers to wake, and poll the others for the spin budget. If the round is
        ``settled``, ``finish`` completes it at once; otherwise ``complete`` does."""
        raw = byte_view(flat)
        size = raw.size
        if size > LANE_BYTES:
            raise ValueError(f"{what}: {size} bytes do not fit the lane's "
                             f"{LANE_BYTES}-byte slots")
        k = self._round + 1
        self._round = k
        parity = k & 1
        me = self.rank
        self._payloads[parity, me, :size] = raw
        self._nbytes[parity, me] = size
        self._dtypes[parity, me] = self._code(flat.dtype)
        self._seq[me] = k
        self._fence()
        asleep = [p for p in self._peers if self._armed[p] == k]
        for p in self._peers:
            self._woke[me, parity, p] = (k << 1) | (p in asleep)
        return LaneRound(k, parity, flat, op, asleep, self._poll(k))

    def _poll(self, k: int) -> list[int]:
        """The peers that have not published round ``k`` after the spin budget."""
        seq = self._seq
        behind = [p for p in self._peers if seq[p] < k]
        if behind and self.spin_seconds > 0:
            clock = time.perf_counter
            end = clock() + self.spin_seconds
            while behind and clock() < end:
                behind = [p for p in behind if seq[p] < k]
        return behind

    async def complete(self, chan: Channel, rnd: LaneRound) -> None:
        """Finish a round ``begin`` started: wake the sleepers it found, sleep on the
        peers still behind, then ``finish``."""
        for p in rnd.asleep:
            await chan.send(p, _SIGNAL, SUB_LANE_WAKE)
        if rnd.behind:
            await self._sleep(chan, rnd.k, rnd.parity, rnd.behind)
        self.finish(rnd, chan.op)

    def finish(self, rnd: LaneRound, what: str) -> None:
        """Step 3: check every peer's header against ours and fold the slots in rank
        order into the array (every peer has published round ``rnd.k``)."""
        flat, parity = rnd.flat, rnd.parity
        size, dtype = flat.nbytes, flat.dtype
        self._check_headers(what, parity, size, dtype)
        slot = [self._payloads[parity, r, :size].view(dtype) for r in range(self.ranks)]
        combine(rnd.op, slot[0], slot[1], flat)
        for r in range(2, self.ranks):
            combine(rnd.op, flat, slot[r], flat)

    async def _sleep(self, chan: Channel, k: int, parity: int, behind: list[int]) -> None:
        """Arm for round ``k`` and receive the TCP wake-up of every peer that owes one."""
        seq = self._seq
        self._armed[self.rank] = k
        self._fence()
        for p in behind:
            if seq[p] < k or await self._woken(chan, p, k, parity):
                await chan.recv(p, sub=SUB_LANE_WAKE)
                if seq[p] < k:
                    raise SharedMemoryError(
                        f"{chan.op}: group rank {p} sent its lane wake-up for round {k} "
                        f"before publishing the round (it shows {int(seq[p])})")

    async def _woken(self, chan: Channel, peer: int, k: int, parity: int) -> bool:
        """Whether ``peer``, which published round ``k`` as this rank armed, sent it a
        wake-up: its ``woke`` record for round ``k``, waited for (module docstring)."""
        record = self._woke[peer, parity]
        me = self.rank
        clock = time.perf_counter
        end = clock() + WOKEN_SPIN_SECONDS
        while int(record[me]) >> 1 != k:
            if clock() >= end:
                # descheduled between publishing and recording: let it run (the
                # collective's deadline bounds this, and a lost peer ends it)
                lost = chan.transport.lost_peer_error(chan.ranks[peer])
                if lost is not None:
                    raise lost
                await asyncio.sleep(0)
        return bool(int(record[me]) & 1)

    def _check_headers(self, what: str, parity: int, size: int, dtype: np.dtype) -> None:
        mine = self._code(dtype)
        for p in self._peers:
            theirs = int(self._nbytes[parity, p])
            code = self._dtypes[parity, p]
            if theirs != size or not np.array_equal(code, mine):
                name = bytes(code).rstrip(b"\0").decode("ascii", "replace")
                raise CollectiveMismatchError(
                    f"{what}: group rank {p} contributed {theirs} bytes of "
                    f"{_wire_name(name)} but group rank {self.rank} has {size} bytes of "
                    f"{dtype_to_wire(dtype)}; every rank must pass the same shape and dtype")


def _wire_name(dtype_str: str) -> str:
    """The wire name (``float32``, ``bfloat16``) of a peer's header dtype, or the raw
    text if it names none."""
    try:
        return dtype_to_wire(np.dtype(dtype_str))
    except TypeError:
        return repr(dtype_str)


async def open_host_lane(chan: Channel, enabled: bool) -> HostLane | None:
    """A lane for ``chan``'s group, or None where it cannot have one (every rank calls
    this at the same collective, the group's first small all-reduce).

    Without messages (beyond learning the host keys, when the transport does not know
    them) when the answer is the same everywhere: the ranks are not all on this host, or
    its processor orders memory too weakly. Otherwise the group's lowest rank creates
    the segment, the others attach, and one exchange agrees: any rank with shared memory
    off or a failed attach puts the group's small all-reduces on TCP (said once, as for
    large collectives).
    """
    layout = await host_layout(chan, enabled)
    if layout.mode is not LocalMode.SINGLE_HOST or not lane_supported():
        return None  # the same answer on every rank: one host, one processor type
    segment, problem = await create_or_attach(chan, layout, enabled,
                                              lane_segment_bytes(chan.world_size))
    segment, _ = await agree_on_segment(chan, segment, problem, None,
                                        "small all-reduces use TCP")
    if segment is None:
        return None
    return HostLane(segment, chan.world_size, chan.rank, chan.transport.spin_seconds)


class LanePath:
    """A group's small all-reduces on one host: set up at the first (``open_host_lane``),
    then run one at a time in issue order (they share the slots and the round count).
    When the setup found no lane, turns are free for all and the caller uses TCP."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lane: HostLane | None = None
        self._decided = False
        self._turns = TurnQueue()

    def ticket(self) -> int:
        """Take the next turn (call when the all-reduce is issued, in issue order)."""
        return self._turns.ticket()

    def done(self, ticket: int) -> None:
        """``ticket``'s all-reduce no longer needs its turn (taken without ``turn``)."""
        self._turns.done(ticket)

    @property
    def idle(self) -> bool:
        """No small all-reduce is waiting for or holding a turn."""
        return self._turns.idle

    @property
    def decided(self) -> bool:
        """True once the first small all-reduce has set the lane up (or found none)."""
        return self._decided

    @contextlib.asynccontextmanager
    async def turn(self, chan: Channel, ticket: int) -> AsyncIterator[HostLane | None]:
        """Wait for ``ticket``'s turn and yield the lane (``None``: use TCP)."""
        try:
            await self._turns.wait(ticket)
            if not self._decided:
                self.lane = await open_host_lane(chan, self.enabled)
                self._decided = True
                self._turns.free = self.lane is None
            yield self.lane
        finally:
            self._turns.done(ticket)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None
