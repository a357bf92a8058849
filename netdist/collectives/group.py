"""``Group``: collectives over a transport, subgroups, tags and async handles.

A group is an ordered set of transport ranks. Every rank of the group must call the same
collectives in the same order (as with NCCL and Gloo); each call takes the next tag from
a per-group counter, so calls issued in the same order match up even when several are in
flight (``async_op=True``).

Tags. Application tags below ``2**32`` stay free at the transport. Group traffic uses
tags with bit 62 set::

    bit 62      1 (netdist group traffic)
    bits 22-61  group id (40 bits; a hash of how the group was created)
    bit 21      0 collective, 1 point-to-point
    bits 4-20   collective sequence number (wraps; FIFO order per tag keeps a reused tag
                safe because every collective consumes exactly the messages it sends)
    bits 0-3    sub-tag within one collective
    bits 0-19   point-to-point: the application's tag (< 2**20)

Group ids are deterministic: the n-th ``Group(transport)`` created on a transport and the
k-th child created by ``new_group`` hash to the same id on every rank, provided every rank
creates groups in the same order.

Algorithms (``small_message_bytes``, default 1 MiB, picks between them; every rank must
use the same setting):

- ``all_reduce``: up to the threshold, recursive doubling (``log2 n`` rounds, with the fold
  for non-powers of two); above it, a pipelined ring reduce-scatter + all-gather, so each
  rank sends and receives ``2(n-1)/n`` of the data. Each ring step's chunk is cut into
  about ``PIECES`` segments of ``MIN_SEGMENT_BYTES .. segment_bytes`` (default 4 MiB):
  segments amortise Python's per-message cost, and several per step let step ``t + 1``
  start before step ``t`` has finished.
- ``reduce_scatter`` / ``all_gather``: ring above the threshold; below it the all-reduce
  (then the own chunk is kept) and Bruck's all-gather.
- ``broadcast``: binomial tree below, pipelined chain above. ``reduce``: binomial tree
  below, ring reduce-scatter + direct gather to the root above.

Every rank ends an all-reduce with bitwise-identical results: the ring reduces each chunk
along one fixed chain and copies the result, and recursive doubling combines operands
lower rank first everywhere.

Reduction semantics. ``SUM``/``PROD`` wrap around on integer overflow (NumPy semantics).
``MEAN`` sums, then divides once by the group size; it is defined for floating dtypes only
(``float16/32/64``, ``bfloat16``) and raises ``TypeError`` for integers and bool, since an
integer mean would silently truncate. ``BAND``/``BOR``/``BXOR`` are bitwise and defined
for integers and bool only. For ``bool``: ``SUM`` and ``MAX`` are logical or, ``PROD`` and
``MIN`` logical and.

Torch tensors. Every collective that takes NumPy arrays also takes CPU tensors
(``netdist.tensors``): a contiguous tensor is used through a NumPy view of its own memory,
with no copy; an in-place collective returns the tensor it was given, the others return
tensors over their result buffers (``torch.from_numpy``), ``out=`` tensors are filled in
place. A non-contiguous tensor follows the rule for non-contiguous arrays: one contiguous
copy, copied back into the tensor by in-place collectives (and into a non-contiguous
``out=`` tensor). A tensor off the CPU raises ``ValueError``. bfloat16 tensors need no
extra package: without ``ml_dtypes`` they travel as raw 16-bit data and reduce as torch
reduces bfloat16 (float32 per pairwise step, rounded to nearest even; see
``netdist.types``). A NumPy caller without ``ml_dtypes`` that *receives* bfloat16 (``recv``,
``gather``, ``scatter`` without ``out=``) gets a ``torch.bfloat16`` tensor if torch is
imported, else a ``TypeError`` naming the dtype and ``pip install 'netdist[bf16]'``.

Failure. Each collective has one deadline, ``timeout`` (default: the group's, which
defaults to the transport's). A lost peer raises ``PeerLostError``, an expired deadline
``NetdistTimeoutError``, mismatched arguments across ranks ``CollectiveMismatchError``;
each message names the operation, the group and the peer (and, after a timeout or a lost
peer, every member the transport already knows is gone). A collective that failed, timed
out or was cancelled leaves the group's tag streams out of step, and on TCP the
connection to a peer whose frame was half received is dropped: treat the group as
broken. Cancelling or timing out never leaves a task behind: the collective's internal
tasks are cancelled and awaited before the error propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import msgpack
import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError, ScratchPool
from netdist.collectives.host.arena import (
    DEFAULT_SLOT_BYTES,
    HostArena,
    HostPath,
    host_all_reduce,
    host_broadcast,
)
from netdist.collectives.host.lane import LANE_BYTES, LanePath
from netdist.collectives.host.layout import LocalMode
from netdist.collectives.host.settings import ShmCopy, shared_memory_copy, shared_memory_enabled
from netdist.collectives.monitored import root_monitored_barrier, root_monitored_limit
from netdist.collectives.objects import pack_object_blob, unpack_object_blob
from netdist.collectives.p2p import recv_from_any, recv_from_any_limit, recv_landing, recv_result
from netdist.collectives.ring import (
    DEFAULT_DEPTH,
    chain_broadcast,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from netdist.collectives.plan import offsets_from_sizes
from netdist.collectives.tags import (
    P2P_BIT,
    P2P_TAG_LIMIT,
    SEQ_MASK,
    SEQ_SHIFT,
    TagRange,
    group_id as make_group_id,
    group_tag_base,
    reserved_range,
)
from netdist.collectives.small import (
    all_to_all_exchange,
    bruck_all_gather,
    bruck_all_gather_blobs,
    dissemination_barrier,
    doubling_all_reduce,
    gather_tasks,
    linear_gather,
    linear_scatter,
    tree_broadcast,
    tree_broadcast_blob,
    tree_reduce,
)
from netdist.collectives.work import EagerStart, Work
from netdist.errors import (
    CollectiveError,
    LocalProtocolError,
    NetdistTimeoutError,
    NotInGroupError,
    PeerLostError,
    TransportClosedError,
)
from netdist.sharding import chunk_bounds
from netdist.transport.base import Transport
from netdist.tensors import as_array, as_arrays, is_tensor, numpy_result, stage_out, to_tensor
from netdist.types import (
    CARRIED_DTYPES,
    ReduceOp,
    check_reduce_dtype,
    divide_into,
    dtype_to_wire,
    eager_start,
)

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "Group",
    "DEFAULT_SMALL_MESSAGE_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "P2P_TAG_LIMIT",
    "TagRange",
    "reserve_tags",
]

DEFAULT_SMALL_MESSAGE_BYTES = 1024 * 1024
"""Messages up to this many bytes use the latency-optimal algorithms."""

DEFAULT_SEGMENT_BYTES = 4 * 1024 * 1024
"""Largest pipeline segment of the ring and chain algorithms."""

PIECES = 4
"""Each ring step's chunk is cut into about this many segments (a chain broadcast into
twice as many), within ``MIN_SEGMENT_BYTES .. segment_bytes``."""

MIN_SEGMENT_BYTES = 256 * 1024
"""Smallest segment the ring and chain algorithms cut a mid-sized message into."""

_ROOT_COUNT_ATTRIBUTE = "_netdist_root_groups"
_RANGES_ATTRIBUTE = "_netdist_tag_ranges"
_REACH_SECONDS = 1.0  # after a timeout: how long to try reaching members never talked to

_WIRE_DTYPE_SET = frozenset(CARRIED_DTYPES.values())

T = TypeVar("T")
ArrayT = TypeVar("ArrayT", np.ndarray, "Tensor")
"""An array-valued collective returns what it was given: NumPy in, NumPy out; torch in,
torch out (``out=`` must then be of the same kind)."""
OutputsT = TypeVar("OutputsT", bound="Sequence[np.ndarray | Tensor]")


def _as_op(op: ReduceOp | str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    names = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r} (expected one of {names})")


def _check_array(array: Any, what: str, *, writeable: bool = False) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} needs a numpy.ndarray, got {type(array).__name__}")
    if array.dtype not in _WIRE_DTYPE_SET:  # fast path: a set lookup, no name strings
        name = dtype_to_wire(array.dtype)  # raises TypeError for unsupported dtypes
        raise TypeError(f"{what}: dtype {array.dtype.str} is big-endian; pass "
                        f"array.astype('{CARRIED_DTYPES[name].str}')")
    if writeable and not array.flags.writeable:
        raise ValueError(f"{what} works in place but the array is read-only")
    return array


def _tensor_io(array: Any, out: Any, what: str
               ) -> tuple[np.ndarray, bool, np.ndarray | None, Any]:
    """``(array, wrap, out, staged)``: NumPy views of a tensor input (``wrap``: return a
    tensor) and of a tensor ``out=`` (``staged`` copies a non-contiguous one back)."""
    wrap = False
    if not isinstance(array, np.ndarray):
        array, wrap = as_array(array, what), True
    staged = None
    if out is not None and not isinstance(out, np.ndarray):
        staged = stage_out(out, f"{what} out=")
        out = staged.array
    return array, wrap, out, staged


def _in_place(array: Any, what: str, writeable: bool) -> tuple[Any, np.ndarray]:
    """``(tensor, array)`` for a collective that works in place: a tensor input and its
    NumPy view (``tensor`` None for a NumPy input), checked for a wire dtype."""
    tensor = None
    if not isinstance(array, np.ndarray):
        tensor, array = array, as_array(array, what, writeable=writeable)
    return tensor, _check_array(array, what, writeable=writeable)


def _timeout_value(timeout: float | None, what: str) -> float | None:
    if timeout is None:
        return None
    if not timeout > 0:
        raise ValueError(f"{what} must be > 0 seconds, got {timeout}")
    return float(timeout)


def _next_root_group(transport: Transport) -> int:
    """Number the next root ``Group`` built on ``transport``: 0, 1, 2, ...

    Every rank builds its root groups in the same order, so equal numbers name the same
    group on every rank and give it the same tag namespace. The count lives on the
    transport object (groups of different transports never share it), owned by ``Group``.
    """
    created: int = getattr(transport, _ROOT_COUNT_ATTRIBUTE, 0)
    setattr(transport, _ROOT_COUNT_ATTRIBUTE, created + 1)
    return created


def reserve_tags(transport: Transport, ranks: Sequence[int], owner: str) -> TagRange:
    """Reserve the next tag range of ``owner`` among transport ``ranks`` on ``transport``.

    The n-th reservation of ``owner`` among the same ranks gets the same range on every
    rank, so the ranks that will talk on it must reserve in the same order (as they
    build subgroups); a second parameter server or pipeline on those ranks gets a range
    of its own. The ranges live in the reserved space of ``netdist.collectives.tags``,
    apart from application tags and from every group's collectives. ``Group.reserve_tags``
    is this for the group's members; layers given a bare transport call it with every rank.
    """
    members = tuple(int(r) for r in ranks)
    taken: dict[tuple[tuple[int, ...], str], int] = getattr(transport, _RANGES_ATTRIBUTE, None) or {}
    index = taken.get((members, owner), 0)
    tag_range = reserved_range(members, owner, index)
    for (other_ranks, other_owner), count in taken.items():
        if (other_ranks, other_owner) != (members, owner) and any(
                reserved_range(other_ranks, other_owner, i).base == tag_range.base
                for i in range(count)):
            raise CollectiveError(f"tag range of {owner!r} on ranks {list(members)} collides "
                                  f"with one of {other_owner!r} on ranks {list(other_ranks)}; "
                                  f"use another owner name")
    taken[(members, owner)] = index + 1
    setattr(transport, _RANGES_ATTRIBUTE, taken)
    return tag_range


class Group:
    """Collectives among an ordered set of ranks of one transport.

    ``Group(transport)`` is the world group (every rank of the transport, in rank
    order); ``group.new_group(ranks)`` makes subgroups. Use as an async context manager,
    or call ``aclose()``, to cancel collectives still running from ``async_op=True``.
    The group does not own the transport and never closes it.
    """

    def __init__(self, transport: Transport, timeout: float | None = None, *,
                 small_message_bytes: int = DEFAULT_SMALL_MESSAGE_BYTES,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 pipeline_depth: int = DEFAULT_DEPTH,
                 shared_memory: bool | None = None,
                 shm_slot_bytes: int = DEFAULT_SLOT_BYTES,
                 shm_copy: ShmCopy | str | None = None) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"Group needs a Transport, got {type(transport).__name__}")
        if not isinstance(small_message_bytes, int) or small_message_bytes < 0:
            raise ValueError(f"small_message_bytes must be an int >= 0, got {small_message_bytes!r}")
        if not isinstance(segment_bytes, int) or segment_bytes < 1:
            raise ValueError(f"segment_bytes must be an int >= 1, got {segment_bytes!r}")
        if not isinstance(pipeline_depth, int) or pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be an int >= 1, got {pipeline_depth!r}")
        if not isinstance(shm_slot_bytes, int) or shm_slot_bytes < 4096:
            raise ValueError(f"shm_slot_bytes must be an int >= 4096, got {shm_slot_bytes!r}")
        timeout = _timeout_value(timeout, "timeout")
        self._setup(transport, tuple(range(transport.world_size)),
                    make_group_id("root", _next_root_group(transport)),
                    float(transport.timeout) if timeout is None else timeout,
                    small_message_bytes, segment_bytes, pipeline_depth,
                    shared_memory_enabled(shared_memory), -(-shm_slot_bytes // 64) * 64,
                    shared_memory_copy(shm_copy))

    def _setup(self, transport: Transport, ranks: tuple[int, ...], gid: int, timeout: float,
               small_message_bytes: int, segment_bytes: int, pipeline_depth: int,
               shared_memory: bool, shm_slot_bytes: int, shm_copy: ShmCopy) -> None:
        self._transport = transport
        self._ranks = ranks
        self._rank = ranks.index(transport.rank) if transport.rank in ranks else -1
        self._gid = gid
        self._tag_base = group_tag_base(gid)
        self._timeout = timeout
        self.small_message_bytes = small_message_bytes
        """Messages up to this size use the latency-optimal algorithms."""
        self.segment_bytes = segment_bytes
        """Largest pipeline segment of the ring and chain algorithms."""
        self.pipeline_depth = pipeline_depth
        """Scratch segments the in-place ring all-reduce rotates through."""
        self.shared_memory = shared_memory
        """Whether this rank offers shared memory to ranks on its host (all must)."""
        self.shm_copy = shm_copy
        """How this rank offers to move an all-reduce on one host (all must agree)."""
        self._host_path = HostPath(shared_memory, shm_slot_bytes, shm_copy)
        self._lane = LanePath(shared_memory)
        self._seq = 0
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._scratch = ScratchPool()
        self._children = 0
        self._tasks: set[asyncio.Future[Any]] = set()
        self._subgroups: list[Group] = []
        self._closed = False

    # -- identity ------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def rank(self) -> int:
        """This process's rank within the group; -1 when it is not a member."""
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Transport ranks of the members, in group order."""
        return self._ranks

    @property
    def is_member(self) -> bool:
        return self._rank >= 0

    @property
    def timeout(self) -> float:
        """Default deadline, in seconds, of each collective."""
        return self._timeout

    @property
    def group_id(self) -> int:
        return self._gid

    def reserve_tags(self, owner: str) -> TagRange:
        """Reserve a range of ``2**32`` transport tags for ``owner`` among this group's ranks.

        For layers above the collectives that talk point to point on their own tags (the
        pipeline, the parameter server): the range is apart from application tags and
        from every group's collectives, and the n-th reservation of ``owner`` names the
        same tags on every member, so members reserve in the same order (see
        ``netdist.collectives.group.reserve_tags``).
        """
        return reserve_tags(self._transport, self._ranks, owner)

    def __repr__(self) -> str:
        return (f"<Group {self._gid:#x} ranks={list(self._ranks)} rank={self._rank}"
                f"{' closed' if self._closed else ''}>")

    def _describe(self) -> str:
        return (f"group {self._gid:#x} (group rank {self._rank} of {self.world_size}, "
                f"transport rank {self._transport.rank})")

    # -- subgroups -----------------------------------------------------------------------

    def new_group(self, ranks: Sequence[int], *, name: str | None = None) -> Group:
        """Make a subgroup of the given *group* ranks, in the given order.

        Without ``name``, every member of this group must call ``new_group`` with the same
        ranks in the same order (even ranks that are not in the subgroup: it advances the
        counter that makes group ids agree). Ranks outside the subgroup get a group with
        ``is_member`` False whose collectives raise ``NotInGroupError``.

        With ``name`` (a string every member of the subgroup agrees on, such as
        ``torch.distributed``'s group name), the id comes from the name and the ranks
        alone: only the subgroup's members need to call, in any order relative to other
        subgroups. Two live subgroups must not share a name.
        """
        self._check_member("new_group")
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"new_group needs a sequence of ranks, got {type(ranks).__name__}")
        members = []
        for r in ranks:
            if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
                raise TypeError(f"new_group ranks must be ints, got {r!r}")
            if not 0 <= r < self.world_size:
                raise ValueError(f"new_group: rank {r} is outside 0..{self.world_size - 1}")
            members.append(int(r))
        if not members:
            raise ValueError("new_group needs at least one rank")
        if len(set(members)) != len(members):
            dups = sorted({r for r in members if members.count(r) > 1})
            raise ValueError(f"new_group: duplicate ranks {dups} in {members}")
        if name is None:
            gid = make_group_id("child", self._gid, self._children, tuple(members))
            self._children += 1
        else:
            gid = make_group_id("named", self._gid, str(name), tuple(members))
        child = Group.__new__(Group)
        child._setup(self._transport, tuple(self._ranks[r] for r in members), gid,
                     self._timeout,
                     self.small_message_bytes, self.segment_bytes, self.pipeline_depth,
                     self.shared_memory, self._host_path.slot_bytes, self.shm_copy)
        self._subgroups.append(child)
        return child

    # -- lifecycle -----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel collectives still running from ``async_op=True`` (this group and its
        subgroups) and wait for them to finish. Idempotent; the transport stays open."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for child in self._subgroups:
            await child.aclose()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._scratch.clear()
        self._host_path.close()
        self._lane.close()

    def close(self) -> None:
        """Cancel outstanding work without waiting (prefer ``aclose``)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for child in self._subgroups:
            child.close()

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # -- plumbing ------------------------------------------------------------------------

    def _check_member(self, op: str) -> None:
        if self._rank < 0:
            raise NotInGroupError(
                f"{op}: transport rank {self._transport.rank} is not a member of group "
                f"{self._gid:#x} (transport ranks {list(self._ranks)})")
        if self._closed:
            raise CollectiveError(f"{op}: {self._describe()} is closed")

    def _next_tag(self) -> int:
        tag = self._tag_base | (self._seq << SEQ_SHIFT)
        self._seq = (self._seq + 1) & SEQ_MASK
        return tag

    def _peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
            raise TypeError(f"{what} must be an int group rank, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what} {peer} is outside 0..{self.world_size - 1}")
        return int(peer)

    def _group_rank_of(self, transport_rank: int) -> str:
        if transport_rank in self._ranks:
            return f"group rank {self._ranks.index(transport_rank)} (transport rank {transport_rank})"
        return f"transport rank {transport_rank}"

    async def _submit(self, op: str, body: Callable[[Channel], Awaitable[T]],
                      timeout: float | None, async_op: bool) -> T | Work:
        """Allocate the next tag now (issue order), then run ``body`` or hand out a Work."""
        deadline = _timeout_value(timeout, "timeout")
        chan = Channel(self._transport, self._ranks, self._rank, self._next_tag(),
                       self._timeout if deadline is None else deadline, op, self._plans,
                       self._scratch)
        if not async_op:
            return await self._run(chan, body)
        return self._launch(chan, body)

    def _launch(self, chan: Channel, body: Callable[[Channel], Awaitable[T]]) -> Work:
        """Run ``body`` as a task the group owns; the ``Work`` handle for it."""
        running = asyncio.Event()
        task = asyncio.ensure_future(self._run(chan, body, running))
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        return Work(task, chan.op, running)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the Work handle re-raises it when awaited

    async def _run(self, chan: Channel, body: Callable[[Channel], Awaitable[T]],
                   running: asyncio.Event | None = None) -> T:
        """Run one collective under its deadline, adding context to transport errors;
        ``running`` is set as the body starts (``Work.started``)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(chan.timeout):
                if running is not None:
                    running.set()
                return await body(chan)
        except NetdistTimeoutError as exc:
            raise NetdistTimeoutError(f"{chan.op} on {self._describe()}: {exc}") from exc
        except TimeoutError:
            elapsed = loop.time() - started
            waiting = ("" if chan.waiting_on < 0 else
                       f", waiting for {self._group_rank_of(self._ranks[chan.waiting_on])}")
            lost = await self._lost_peers(reach=_REACH_SECONDS)
            raise NetdistTimeoutError(
                f"{chan.op} on {self._describe()} timed out after {elapsed:.2f}s"
                f"{waiting}{'; ' + '; '.join(lost) if lost else ''}") from None
        except PeerLostError as exc:
            # a peer that left because *it* lost someone points at the real casualty:
            # name every member the transport knows is gone
            others = await self._lost_peers(exclude=exc.rank)
            member = self._group_rank_of(exc.rank)
            # relayed (``via``): the transport's text already leads with the origin
            story = f"lost {member}: {exc}" if exc.via is None else f"{exc} (lost {member})"
            raise exc.with_message(
                f"{chan.op} on {self._describe()}: {story}"
                f"{'; also ' + '; '.join(others) if others else ''}") from exc
        except TransportClosedError as exc:
            raise TransportClosedError(f"{chan.op} on {self._describe()}: {exc}") from exc
        except LocalProtocolError as exc:
            raise CollectiveMismatchError(
                f"{chan.op} on {self._describe()}: {exc}; every rank must pass the same "
                "shape and dtype") from exc

    async def _lost_peers(self, exclude: int = -1, *, reach: float = 0.0) -> list[str]:
        """Which members are gone, for error messages: what the transport knows, and
        after a timeout (``reach`` seconds) also members this rank never talked to, which
        a transport connecting on first use then tries to reach."""
        peers = [p for p in self._ranks if p not in (self._transport.rank, exclude)]
        if not peers or self._transport.closed:
            return []
        found = await self._transport.find_lost_peers(peers, timeout=reach)
        return [f"{self._group_rank_of(p)} is lost: {found[p]}" for p in peers if p in found]

    def _flat(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(work, flat)``: a C-contiguous working array and its 1-D view."""
        work = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return work, work.reshape(-1)

    def _segment(self, dtype: np.dtype[Any], nbytes: int, pieces: int) -> int:
        """Segment length in elements for pipelining ``nbytes`` in about ``pieces`` parts.

        ``segment_bytes`` is the largest segment; smaller messages are cut finer (down
        to ``MIN_SEGMENT_BYTES``) so that a step can forward its first segment long
        before its last one has arrived.
        """
        largest = self.segment_bytes
        seg = min(largest, max(min(MIN_SEGMENT_BYTES, largest), nbytes // pieces))
        return max(1, seg // max(1, dtype.itemsize))

    def _ticket(self, nbytes: int) -> int | None:
        """A turn on the same-host path for a collective of ``nbytes`` (``None``: too small
        to gain from shared memory, or a group of one). Taken at issue, in issue order."""
        if self.world_size < 2 or nbytes <= self.small_message_bytes:
            return None
        return self._host_path.ticket()

    def _lane_ticket(self, nbytes: int) -> int | None:
        """A turn on the same-host lane for a small all-reduce of ``nbytes`` (``None``:
        too large for it, or a group of one). Taken at issue, in issue order, by every
        rank alike: whether the group has a lane is agreed inside the first turn."""
        if self.world_size < 2 or not 0 < nbytes <= LANE_BYTES:
            return None
        return self._lane.ticket()

    @property
    def has_lane(self) -> bool | None:
        """Whether small all-reduces pass through shared memory (every rank on this
        host, shared memory on, x86-64); ``None`` until the first one has run."""
        return self._lane.lane is not None if self._lane.decided else None

    @property
    def local_mode(self) -> LocalMode | None:
        """How large collectives move data (``None`` until the first one has run)."""
        layout = self._host_path.layout
        if layout is None:
            return None
        return LocalMode.TCP if self._host_path.arena is None else layout.mode

    @property
    def local_copy(self) -> ShmCopy | None:
        """How a large all-reduce on one host moves bytes: ``SINGLE`` (ranks read each
        other's arrays) or ``STAGED`` (through the segment); ``None`` until the first
        large collective, or when it does not use shared memory."""
        arena = self._host_path.arena
        return None if arena is None else arena.copy

    # -- collectives ---------------------------------------------------------------------

    @overload
    async def all_reduce(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                         timeout: float | None = None,
                         async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def all_reduce(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                         timeout: float | None = None,
                         async_op: Literal[True]) -> Work: ...
    @overload
    async def all_reduce(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                         timeout: float | None = None,
                         async_op: bool) -> ArrayT | Work: ...
    @eager_start("all_reduce_eager")
    async def all_reduce(self, array: np.ndarray | Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                         timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks, in place; returns ``array`` (or a ``Work``).

        Every rank must pass the same shape and dtype. See the module docstring for the
        algorithm choice, for ``MEAN`` and ``bool`` semantics and for torch tensors.
        """
        self._check_member("all_reduce")
        op = _as_op(op)
        tensor, array = _in_place(array, "all_reduce", True)
        check_reduce_dtype(op, array.dtype, "all_reduce")
        work, flat = self._flat(array)
        n = self.world_size
        ticket = self._ticket(flat.nbytes)
        lane_ticket = None if ticket is not None else self._lane_ticket(flat.nbytes)

        async def body(chan: Channel) -> Any:
            if n > 1 and flat.size:
                mean = op is ReduceOp.MEAN
                segment = self._segment(flat.dtype, flat.nbytes // n, PIECES)
                if ticket is None:
                    if lane_ticket is None:
                        await doubling_all_reduce(chan, flat, op)
                    else:
                        async with self._lane.turn(chan, lane_ticket) as lane:
                            if lane is not None:
                                await lane.all_reduce(chan, flat, op)
                            else:
                                await doubling_all_reduce(chan, flat, op)
                    if mean:
                        divide_into(flat, n)
                else:
                    async with self._host_path.turn(chan, ticket) as arena:
                        if arena is not None:
                            await host_all_reduce(chan, arena, flat, op, mean, segment,
                                                  self.pipeline_depth)
                        else:
                            await ring_all_reduce(chan, flat, op, segment, self.pipeline_depth,
                                                  divisor=n if mean else None)
            if work is not array:
                array[...] = work
            return array if tensor is None else tensor

        return await self._submit("all_reduce", body, timeout, async_op)

    def all_reduce_eager(self, array: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                         timeout: float | None = None,
                         async_op: bool = False) -> EagerStart | None:
        """Start a small all-reduce of ``array`` in place on this thread, without the
        event loop: for a blocking caller that holds the loop (``ProgressThread.try_call``),
        where a loop iteration costs more than the all-reduce itself.

        It takes ``all_reduce``'s arguments and runs only for a blocking call where the
        group's lane is set up, no earlier small all-reduce is pending and ``array`` is a
        writeable C-contiguous NumPy array of at most ``LANE_BYTES``; otherwise it
        returns ``None`` having done nothing, and the caller uses ``all_reduce``. Started,
        it returns an ``EagerStart`` whose ``rest`` is ``None`` if the call finished here
        (every peer was already there or arrived within the spin budget), or a coroutine
        the caller must run on the loop, which finishes the call under its deadline with
        ``all_reduce``'s errors. The blocking API calls it for ``all_reduce``
        (``eager_start``).
        """
        lane = self._lane.lane
        if (lane is None or async_op or self._closed or self._rank < 0
                or not self._lane.idle or not isinstance(array, np.ndarray)
                or array.dtype not in _WIRE_DTYPE_SET or not array.flags.c_contiguous
                or not array.flags.writeable or not 0 < array.nbytes <= LANE_BYTES):
            return None  # all_reduce itself runs it, or raises what is wrong
        op = _as_op(op)
        check_reduce_dtype(op, array.dtype, "all_reduce")
        deadline = _timeout_value(timeout, "timeout")
        chan = Channel(self._transport, self._ranks, self._rank, self._next_tag(),
                       self._timeout if deadline is None else deadline, "all_reduce",
                       self._plans, self._scratch)
        ticket = self._lane.ticket()
        flat = array.reshape(-1)
        n = self.world_size
        try:
            rnd = lane.begin(flat, op, chan.op)
            if rnd.settled:
                lane.finish(rnd, chan.op)
                if op is ReduceOp.MEAN:
                    divide_into(flat, n)
        except BaseException:
            self._lane.done(ticket)
            raise
        if rnd.settled:
            self._lane.done(ticket)
            return EagerStart(array, None)

        async def rest(chan: Channel) -> None:
            try:
                await lane.complete(chan, rnd)
            finally:
                self._lane.done(ticket)
            if op is ReduceOp.MEAN:
                divide_into(flat, n)

        return EagerStart(array, self._run(chan, rest))

    @overload
    async def reduce_scatter(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def reduce_scatter(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: Literal[True]) -> Work: ...
    @overload
    async def reduce_scatter(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: bool) -> ArrayT | Work: ...
    async def reduce_scatter(self, array: np.ndarray | Tensor,
                             op: ReduceOp | str = ReduceOp.SUM, *,
                             out: np.ndarray | Tensor | None = None,
                             timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks and return this rank's chunk of the result.

        ``array`` is flattened and split by ``chunk_bounds(array.size, world_size)`` (the
        first ``size % n`` chunks one element longer); this rank gets chunk ``rank`` as a
        1-D array, or in ``out`` (same dtype, exactly the chunk's number of elements).
        ``array`` itself is not modified. A tensor ``array`` gives a tensor result.
        """
        self._check_member("reduce_scatter")
        op = _as_op(op)
        array, wrap, out, staged = _tensor_io(array, out, "reduce_scatter")
        _check_array(array, "reduce_scatter")
        check_reduce_dtype(op, array.dtype, "reduce_scatter")
        _, flat = self._flat(array)
        n = self.world_size
        lo, hi = chunk_bounds(flat.size, n)[self._rank]
        if out is None:
            result = np.empty(hi - lo, array.dtype)
        else:
            _check_array(out, "reduce_scatter out=", writeable=True)
            if out.dtype != array.dtype:
                raise ValueError(f"reduce_scatter: out= has dtype {out.dtype.name}, "
                                 f"input has {array.dtype.name}")
            if out.size != hi - lo:
                raise ValueError(
                    f"reduce_scatter: out= holds {out.size} elements but group rank "
                    f"{self._rank}'s chunk of {flat.size} elements over {n} ranks has "
                    f"{hi - lo}")
            if not out.flags.c_contiguous:
                raise ValueError("reduce_scatter: out= must be C-contiguous")
            result = out
        out_flat = result.reshape(-1)
        ticket = self._ticket(flat.nbytes)

        async def body(chan: Channel) -> np.ndarray:
            if n == 1 or flat.size == 0:
                out_flat[...] = flat[lo:hi]
            elif ticket is None:
                scratch = flat.copy()
                await doubling_all_reduce(chan, scratch, op)
                out_flat[...] = scratch[lo:hi]
            else:
                async with self._host_path.turn(chan, ticket) as arena:
                    if arena is not None and arena.layout.mode is LocalMode.SINGLE_HOST:
                        await arena.reduce_scatter(chan, flat, op, chunk_bounds(flat.size, n),
                                                   out_flat, None)
                    else:
                        await ring_reduce_scatter(
                            chan, flat, op, out_flat,
                            self._segment(flat.dtype, flat.nbytes // n, PIECES))
            if op is ReduceOp.MEAN and n > 1:
                divide_into(out_flat, n)
            if staged is not None:
                return staged.finish()
            return to_tensor(result) if wrap else result

        return await self._submit("reduce_scatter", body, timeout, async_op)

    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None,
                         async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None,
                         async_op: Literal[True]) -> Work: ...
    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None,
                         async_op: bool) -> ArrayT | Work: ...
    async def all_gather(self, shard: np.ndarray | Tensor, *,
                         out: np.ndarray | Tensor | None = None,
                         timeout: float | None = None, async_op: bool = False) -> Any:
        """Concatenate every rank's ``shard`` along axis 0, in group rank order.

        Shards may have different lengths along axis 0 (trailing dims and dtype must
        agree). Without ``out`` the ranks first exchange their shard shapes (one cheap
        latency-bound step) and a new array is returned. With ``out`` (shape
        ``(total, *shard.shape[1:])``) the shard sizes are taken to be
        ``chunk_bounds(total, world_size)``, the rule ``reduce_scatter`` and
        ``shard_tensor`` use, no shape exchange happens and every shard lands straight
        in its final place. A 0-d shard counts as one row. A tensor shard gives a tensor
        result.
        """
        self._check_member("all_gather")
        shard, wrap, out, staged = _tensor_io(shard, out, "all_gather")
        _check_array(shard, "all_gather")
        mine = shard.reshape(1) if shard.ndim == 0 else shard
        mine = mine if mine.flags.c_contiguous else np.ascontiguousarray(mine)
        n = self.world_size
        trailing = mine.shape[1:]
        row = int(np.prod(trailing, dtype=np.int64))
        if out is not None:
            _check_array(out, "all_gather out=", writeable=True)
            if out.dtype != mine.dtype:
                raise ValueError(f"all_gather: out= has dtype {out.dtype.name}, shard has "
                                 f"{mine.dtype.name}")
            if out.ndim == 0 or out.shape[1:] != trailing:
                raise ValueError(f"all_gather: out= has shape {out.shape}; expected "
                                 f"(rows, {', '.join(map(str, trailing))}) for shards of "
                                 f"shape {shard.shape}")
            if not out.flags.c_contiguous:
                raise ValueError("all_gather: out= must be C-contiguous")
            rows = [b - a for a, b in chunk_bounds(out.shape[0], n)]
            if rows[self._rank] != mine.shape[0]:
                raise ValueError(
                    f"all_gather: out= has {out.shape[0]} rows, so group rank {self._rank} "
                    f"must contribute {rows[self._rank]} rows (chunk_bounds over {n} ranks) "
                    f"but its shard has {mine.shape[0]}")
        # without out= the total size is only known after the shape exchange
        ticket = self._ticket(2**63 if out is None else out.nbytes)

        async def body(chan: Channel) -> np.ndarray:
            if ticket is None:
                return await gather(chan)
            async with self._host_path.turn(chan, ticket) as arena:
                return await gather(chan, arena)

        async def gather(chan: Channel, arena: HostArena | None = None) -> np.ndarray:
            if out is None:
                sizes = await self._exchange_shapes(chan, mine)
                result = np.empty((sum(sizes), *trailing), mine.dtype)
            else:
                sizes, result = rows, out
            out_flat = result.reshape(-1)
            chunks = tuple((a * row, b * row) for a, b in offsets_from_sizes(sizes))
            a, b = chunks[self._rank]
            place, own = out_flat[a:b], mine.reshape(-1)
            if place.ctypes.data != own.ctypes.data:  # not already in place
                place[...] = own
            if n > 1 and out_flat.size:
                data = chan.derive(1)
                try:
                    if (arena is not None and arena.layout.mode is LocalMode.SINGLE_HOST
                            and out_flat.nbytes > self.small_message_bytes):
                        await arena.all_gather(chan, out_flat, chunks)
                    elif out_flat.nbytes <= self.small_message_bytes:
                        await bruck_all_gather(data, out_flat, chunks)
                    else:
                        await ring_all_gather(data, out_flat, chunks,
                                              self._segment(out_flat.dtype,
                                                            out_flat.nbytes // n, PIECES))
                finally:
                    chan.waiting_on = data.waiting_on
            if staged is not None:
                return staged.finish()
            return to_tensor(result) if wrap else result

        return await self._submit("all_gather", body, timeout, async_op)

    async def _exchange_shapes(self, chan: Channel, mine: np.ndarray) -> list[int]:
        """All-gather every rank's shard shape and dtype; ``CollectiveMismatchError`` if
        trailing dims or dtypes differ (raised identically on every rank)."""
        name = dtype_to_wire(mine.dtype)  # bfloat16 is one name with or without ml_dtypes
        meta = msgpack.packb([name, list(mine.shape)])
        blobs = await bruck_all_gather_blobs(chan, meta)
        sizes = []
        for source, blob in enumerate(blobs):
            dtype_name, shape = msgpack.unpackb(blob)
            if dtype_name != name or tuple(shape[1:]) != mine.shape[1:]:
                raise CollectiveMismatchError(
                    f"all_gather: group rank {source} has a {dtype_name} shard of shape "
                    f"{tuple(shape)} but group rank {self._rank} has {name} "
                    f"{mine.shape}; dtype and trailing dims must agree")
            sizes.append(int(shape[0]))
        return sizes

    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: Literal[True]) -> Work: ...
    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: bool) -> ArrayT | Work: ...
    async def broadcast(self, array: np.ndarray | Tensor, src: int, *,
                        timeout: float | None = None, async_op: bool = False) -> Any:
        """Copy ``array`` from group rank ``src`` into ``array`` on every rank, in place."""
        self._check_member("broadcast")
        src = self._peer(src, "broadcast src")
        tensor, array = _in_place(array, "broadcast", True)
        work, flat = self._flat(array)
        ticket = self._ticket(flat.nbytes)

        async def body(chan: Channel) -> Any:
            if self.world_size > 1 and flat.size:
                if ticket is None:
                    await tree_broadcast(chan, flat, src)
                    return finish()
                # a chain of two has nothing to overlap: one message is cheapest
                segment = (flat.size if self.world_size == 2 else
                           self._segment(flat.dtype, flat.nbytes, 2 * PIECES))
                async with self._host_path.turn(chan, ticket) as arena:
                    if arena is not None:
                        await host_broadcast(chan, arena, flat, src, segment)
                    else:
                        await chain_broadcast(chan, flat, src, segment)
            return finish()

        def finish() -> Any:
            if work is not array:
                array[...] = work
            return array if tensor is None else tensor

        return await self._submit("broadcast", body, timeout, async_op)

    @overload
    async def reduce(self, array: ArrayT, dst: int, op: ReduceOp | str = ReduceOp.SUM, *,
                     timeout: float | None = None,
                     async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def reduce(self, array: ArrayT, dst: int, op: ReduceOp | str = ReduceOp.SUM, *,
                     timeout: float | None = None,
                     async_op: Literal[True]) -> Work: ...
    @overload
    async def reduce(self, array: ArrayT, dst: int, op: ReduceOp | str = ReduceOp.SUM, *,
                     timeout: float | None = None,
                     async_op: bool) -> ArrayT | Work: ...
    async def reduce(self, array: np.ndarray | Tensor, dst: int,
                     op: ReduceOp | str = ReduceOp.SUM, *,
                     timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks into ``array`` on group rank ``dst``.

        Returns ``array``; on other ranks ``array`` is left unchanged.
        """
        self._check_member("reduce")
        dst = self._peer(dst, "reduce dst")
        op = _as_op(op)
        tensor, array = _in_place(array, "reduce", self._rank == dst)
        check_reduce_dtype(op, array.dtype, "reduce")
        work, flat = self._flat(array)
        n = self.world_size
        root = self._rank == dst

        async def body(chan: Channel) -> Any:
            if n > 1 and flat.size:
                if flat.nbytes <= self.small_message_bytes:
                    await tree_reduce(chan, flat, op, dst, flat if root else flat.copy())
                else:
                    await self._ring_reduce(chan, flat, op, dst)
                if root and op is ReduceOp.MEAN:
                    divide_into(flat, n)
                if root and work is not array:
                    array[...] = work
            return array if tensor is None else tensor

        return await self._submit("reduce", body, timeout, async_op)

    async def _ring_reduce(self, chan: Channel, flat: np.ndarray, op: ReduceOp,
                           dst: int) -> None:
        n = self.world_size
        bounds = chunk_bounds(flat.size, n)
        lo, hi = bounds[self._rank]
        shard = np.empty(hi - lo, flat.dtype)
        await ring_reduce_scatter(chan, flat, op, shard,
                                  self._segment(flat.dtype, flat.nbytes // n, PIECES))
        gather = chan.derive(1)
        try:
            if self._rank != dst:
                await gather.send(dst, shard)
                return
            await gather_tasks([gather.recv(p, flat[a:b]) for p, (a, b) in enumerate(bounds)
                                 if p != dst and b > a])
            flat[lo:hi] = shard
        finally:
            chan.waiting_on = gather.waiting_on

    @overload
    async def gather(self, array: ArrayT, dst: int, *, timeout: float | None = None,
                     async_op: Literal[False] = False) -> list[ArrayT] | None: ...
    @overload
    async def gather(self, array: ArrayT, dst: int, *, timeout: float | None = None,
                     async_op: Literal[True]) -> Work: ...
    @overload
    async def gather(self, array: ArrayT, dst: int, *, timeout: float | None = None,
                     async_op: bool) -> list[ArrayT] | None | Work: ...
    async def gather(self, array: np.ndarray | Tensor, dst: int, *,
                     timeout: float | None = None, async_op: bool = False) -> Any:
        """Collect every rank's ``array`` on group rank ``dst``.

        Returns the list of arrays in group rank order on ``dst`` (its own entry is a
        copy), None elsewhere. Arrays may differ in shape and dtype. If ``dst`` passed a
        tensor, the list holds tensors (over the received buffers).
        """
        self._check_member("gather")
        dst = self._peer(dst, "gather dst")
        array, wrap, _, _ = _tensor_io(array, None, "gather")
        _check_array(array, "gather")
        payload = array if array.flags.c_contiguous else np.ascontiguousarray(array)

        async def body(chan: Channel) -> list[Any] | None:
            results = await linear_gather(chan, payload, dst)
            if results is None:
                return None
            if wrap:
                return [to_tensor(r) for r in results]
            return [numpy_result(r, "gather") for r in results]

        return await self._submit("gather", body, timeout, async_op)

    @overload
    async def scatter(self, arrays: Sequence[ArrayT] | None, src: int, *, out: ArrayT,
                      timeout: float | None = None,
                      async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def scatter(self, arrays: Sequence[np.ndarray] | None, src: int, *,
                      out: None = None, timeout: float | None = None,
                      async_op: Literal[False] = False) -> np.ndarray: ...
    @overload
    async def scatter(self, arrays: Sequence[np.ndarray | Tensor] | None, src: int, *,
                      out: None = None, timeout: float | None = None,
                      async_op: Literal[False] = False) -> np.ndarray | Tensor: ...
    @overload
    async def scatter(self, arrays: Sequence[np.ndarray | Tensor] | None, src: int, *,
                      out: np.ndarray | Tensor | None = None, timeout: float | None = None,
                      async_op: Literal[True]) -> Work: ...
    @overload
    async def scatter(self, arrays: Sequence[np.ndarray | Tensor] | None, src: int, *,
                      out: np.ndarray | Tensor | None = None, timeout: float | None = None,
                      async_op: bool) -> np.ndarray | Tensor | Work: ...
    async def scatter(self, arrays: Sequence[np.ndarray | Tensor] | None, src: int, *,
                      out: np.ndarray | Tensor | None = None,
                      timeout: float | None = None, async_op: bool = False) -> Any:
        """Send ``arrays[i]`` from group rank ``src`` to group rank ``i``.

        ``arrays`` (one array per rank, any shapes) is read on ``src`` only; pass None
        elsewhere. Returns this rank's array (a copy on ``src``), or writes it into
        ``out`` (C-contiguous array or any CPU tensor holding exactly its bytes) and
        returns ``out``. Tensors from ``src`` come back as tensors there; elsewhere pass
        a tensor ``out=`` to receive into one.
        """
        self._check_member("scatter")
        src = self._peer(src, "scatter src")
        payloads: list[np.ndarray] | None = None
        wrap = False
        if self._rank == src:
            if (arrays is None or isinstance(arrays, np.ndarray) or is_tensor(arrays)
                    or len(arrays) != self.world_size):
                count = "None" if arrays is None else (
                    "an array" if isinstance(arrays, np.ndarray) or is_tensor(arrays)
                    else f"{len(arrays)} arrays")
                raise ValueError(f"scatter: source rank {src} must pass a list of "
                                 f"{self.world_size} arrays, got {count}")
            wrap = not isinstance(arrays[self._rank], np.ndarray)
            payloads = [np.ascontiguousarray(_check_array(a, f"scatter arrays[{i}]"))
                        for i, a in enumerate(as_arrays(arrays, "scatter arrays"))]
        staged = None
        landing: np.ndarray | None = None
        if out is not None:
            if isinstance(out, np.ndarray):
                _check_array(out, "scatter out=", writeable=True)
                if not out.flags.c_contiguous:
                    raise ValueError("scatter: out= must be C-contiguous")
                landing = out
            else:
                staged = stage_out(out, "scatter out=")
                landing = staged.array
            if payloads is not None and payloads[src].nbytes != landing.nbytes:
                raise ValueError(f"scatter: out= holds {landing.nbytes} bytes but this rank "
                                 f"sends itself {payloads[src].nbytes}")

        async def body(chan: Channel) -> Any:
            result = await linear_scatter(chan, payloads, src, landing)
            if out is None:
                return to_tensor(result) if wrap else numpy_result(result, "scatter")
            return out if staged is None else staged.finish()

        return await self._submit("scatter", body, timeout, async_op)

    @overload
    async def all_to_all(self, inputs: Sequence[np.ndarray | Tensor], outputs: OutputsT, *,
                         timeout: float | None = None,
                         async_op: Literal[False] = False) -> OutputsT: ...
    @overload
    async def all_to_all(self, inputs: Sequence[np.ndarray | Tensor], outputs: OutputsT, *,
                         timeout: float | None = None,
                         async_op: Literal[True]) -> Work: ...
    @overload
    async def all_to_all(self, inputs: Sequence[np.ndarray | Tensor], outputs: OutputsT, *,
                         timeout: float | None = None,
                         async_op: bool) -> OutputsT | Work: ...
    async def all_to_all(self, inputs: Sequence[np.ndarray | Tensor],
                         outputs: Sequence[np.ndarray | Tensor], *,
                         timeout: float | None = None, async_op: bool = False) -> Any:
        """Send ``inputs[j]`` to group rank ``j`` and receive group rank ``j``'s array for
        this rank into ``outputs[j]``; returns ``outputs``.

        Each rank passes one input and one output array per member (any shapes; every
        ``outputs[j]`` must hold exactly the bytes rank ``j`` sends here, or
        ``CollectiveMismatchError`` names the pair). All exchanges run concurrently, so
        the time is that of the busiest link rather than a sum of rounds. Inputs and
        outputs may be tensors (a non-contiguous output tensor is filled through a
        contiguous copy).
        """
        self._check_member("all_to_all")
        n = self.world_size
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"all_to_all needs {n} input and {n} output arrays (one per "
                             f"member), got {len(inputs)} and {len(outputs)}")
        sends = [np.ascontiguousarray(_check_array(a, f"all_to_all inputs[{j}]"))
                 for j, a in enumerate(as_arrays(inputs, "all_to_all inputs"))]
        staged = [None if isinstance(o, np.ndarray) else stage_out(o, f"all_to_all outputs[{j}]")
                  for j, o in enumerate(outputs)]
        landings: list[np.ndarray] = [o if s is None else s.array  # type: ignore[misc]
                                      for o, s in zip(outputs, staged)]
        for j, out in enumerate(landings):
            _check_array(out, f"all_to_all outputs[{j}]", writeable=True)
            if not out.flags.c_contiguous:
                raise ValueError(f"all_to_all: outputs[{j}] must be C-contiguous")
        me = self._rank
        if landings[me].nbytes != sends[me].nbytes:
            raise ValueError(f"all_to_all: outputs[{me}] holds {landings[me].nbytes} bytes "
                             f"but this rank sends itself {sends[me].nbytes}")

        async def body(chan: Channel) -> Sequence[Any]:
            await all_to_all_exchange(chan, sends, landings)
            for s in staged:
                if s is not None:
                    s.finish()
            return outputs

        return await self._submit("all_to_all", body, timeout, async_op)

    @overload
    async def barrier(self, *, timeout: float | None = None,
                      async_op: Literal[False] = False) -> None: ...
    @overload
    async def barrier(self, *, timeout: float | None = None,
                      async_op: Literal[True]) -> Work: ...
    @overload
    async def barrier(self, *, timeout: float | None = None,
                      async_op: bool) -> None | Work: ...
    async def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Wait until every member has entered the barrier (dissemination, no root)."""
        self._check_member("barrier")

        async def body(chan: Channel) -> None:
            await dissemination_barrier(chan)

        return await self._submit("barrier", body, timeout, async_op)

    async def monitored_barrier(self, *, timeout: float | None = None,
                                wait_all_ranks: bool = False, async_op: bool = False) -> Any:
        """A barrier through group rank 0 that names the ranks that did not arrive within
        ``timeout`` (rank 0 raises ``NetdistTimeoutError`` naming the first, or every one
        with ``wait_all_ranks``; the others then fail too): Gloo's ``monitoredBarrier``,
        ``netdist.collectives.monitored``. As there, ``timeout=0`` gives rank 0 no time."""
        self._check_member("monitored_barrier")
        seconds = 0.0 if timeout == 0 else _timeout_value(timeout, "timeout") or self._timeout

        async def body(chan: Channel) -> None:
            await root_monitored_barrier(chan, seconds, wait_all_ranks)

        return await self._submit("monitored_barrier", body,
                                  root_monitored_limit(seconds, self.world_size), async_op)

    @overload
    async def all_gather_object(self, obj: Any, *, timeout: float | None = None,
                                async_op: Literal[False] = False) -> list[Any]: ...
    @overload
    async def all_gather_object(self, obj: Any, *, timeout: float | None = None,
                                async_op: Literal[True]) -> Work: ...
    @overload
    async def all_gather_object(self, obj: Any, *, timeout: float | None = None,
                                async_op: bool) -> list[Any] | Work: ...
    async def all_gather_object(self, obj: Any, *, timeout: float | None = None,
                                async_op: bool = False) -> Any:
        """Gather one msgpack-able object per rank; returns the list in group rank order.

        msgpack only (tuples come back as lists), never pickle. A rank whose object cannot
        be encoded raises ``TypeError``; the others raise ``CollectiveError`` naming it.
        """
        self._check_member("all_gather_object")
        blob, error = pack_object_blob(obj, "all_gather_object")

        async def body(chan: Channel) -> list[Any]:
            blobs = await bruck_all_gather_blobs(chan, blob)
            if error is not None:
                raise error
            return [unpack_object_blob(b, chan.op, source) for source, b in enumerate(blobs)]

        return await self._submit("all_gather_object", body, timeout, async_op)

    @overload
    async def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None,
                               async_op: Literal[False] = False) -> Any: ...
    @overload
    async def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None,
                               async_op: Literal[True]) -> Work: ...
    @overload
    async def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None,
                               async_op: bool) -> Any | Work: ...
    async def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None,
                               async_op: bool = False) -> Any:
        """Return group rank ``src``'s ``obj`` on every rank (msgpack only, never pickle).

        ``obj`` is ignored on other ranks. If ``src`` cannot encode it, ``src`` raises
        ``TypeError`` and the others ``CollectiveError``.
        """
        self._check_member("broadcast_object")
        src = self._peer(src, "broadcast_object src")
        blob, error = (pack_object_blob(obj, "broadcast_object") if self._rank == src
                       else (b"", None))

        async def body(chan: Channel) -> Any:
            received = await tree_broadcast_blob(chan, blob, src)
            if error is not None:
                raise error
            return unpack_object_blob(received, chan.op, src)

        return await self._submit("broadcast_object", body, timeout, async_op)

    # -- point to point ------------------------------------------------------------------

    def _p2p_tag(self, tag: int) -> int:
        if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
            raise TypeError(f"tag must be an int, got {type(tag).__name__}")
        if not 0 <= tag < P2P_TAG_LIMIT:
            raise ValueError(f"group send/recv tag must be in 0..{P2P_TAG_LIMIT - 1}, got {tag}")
        return self._tag_base | P2P_BIT | int(tag)

    async def _p2p(self, op: str, body: Callable[[], Awaitable[T]], timeout: float,
                   peer: int, async_op: bool) -> T | Work:
        chan = Channel(self._transport, self._ranks, self._rank, 0, timeout, op)
        chan.waiting_on = peer

        async def run(_: Channel) -> T:
            return await body()

        if not async_op:
            return await self._run(chan, run)
        return self._launch(chan, run)

    @overload
    async def send(self, array: Any, dst: int, tag: int = 0, *, timeout: float | None = None,
                   async_op: Literal[False] = False) -> None: ...
    @overload
    async def send(self, array: Any, dst: int, tag: int = 0, *, timeout: float | None = None,
                   async_op: Literal[True]) -> Work: ...
    @overload
    async def send(self, array: Any, dst: int, tag: int = 0, *, timeout: float | None = None,
                   async_op: bool) -> None | Work: ...
    async def send(self, array: Any, dst: int, tag: int = 0, *, timeout: float | None = None,
                   async_op: bool = False) -> Any:
        """Send ``array`` (ndarray, CPU tensor or bytes-like) to group rank ``dst`` on
        ``tag`` (< 2**20).

        Tags are namespaced per group: they never meet the parent's or another group's.
        A non-contiguous array or tensor is sent from a contiguous copy.
        """
        self._check_member("send")
        if not isinstance(array, np.ndarray) and is_tensor(array):
            array = as_array(array, "send")
        dst = self._peer(dst, "send dst")
        if dst == self._rank:
            raise ValueError(f"send dst {dst} is this rank")
        wire_tag = self._p2p_tag(tag)
        deadline = _timeout_value(timeout, "timeout") or self._timeout
        target = self._ranks[dst]

        async def body() -> None:
            await self._transport.send(target, array, tag=wire_tag, timeout=deadline)

        return await self._p2p("send", body, deadline, dst, async_op)

    @overload
    async def recv(self, src: int, tag: int = 0, *, out: None = None,
                   timeout: float | None = None,
                   async_op: Literal[False] = False) -> np.ndarray: ...
    @overload
    async def recv(self, src: int, tag: int = 0, *, out: ArrayT,
                   timeout: float | None = None,
                   async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    async def recv(self, src: int, tag: int = 0, *, out: np.ndarray | Tensor | None = None,
                   timeout: float | None = None, async_op: Literal[True]) -> Work: ...
    @overload
    async def recv(self, src: int, tag: int = 0, *, out: np.ndarray | Tensor | None = None,
                   timeout: float | None = None,
                   async_op: bool) -> np.ndarray | Tensor | Work: ...
    async def recv(self, src: int, tag: int = 0, *, out: np.ndarray | Tensor | None = None,
                   timeout: float | None = None, async_op: bool = False) -> Any:
        """Receive the next message from group rank ``src`` on ``tag`` (into ``out``).

        ``out`` may be a CPU tensor (a non-contiguous one is filled through a contiguous
        copy); it is returned. Without ``out`` the message comes back as a new array
        (bfloat16 without ``ml_dtypes``: see the module docstring).
        """
        self._check_member("recv")
        src = self._peer(src, "recv src")
        if src == self._rank:
            raise ValueError(f"recv src {src} is this rank")
        wire_tag = self._p2p_tag(tag)
        deadline = _timeout_value(timeout, "timeout") or self._timeout
        source = self._ranks[src]
        into, staged = recv_landing(out, "recv")

        async def body() -> Any:
            result = await self._transport.recv(source, tag=wire_tag, out=into,
                                                timeout=deadline)
            return recv_result(result, out, staged, "recv")

        return await self._p2p("recv", body, deadline, src, async_op)

    async def recv_any(self, sources: Sequence[int] | None = None, tag: int = 0, *,
                       out: np.ndarray | Tensor | None = None, timeout: float | None = None,
                       async_op: bool = False) -> Any:
        """``(src, message)``: the next message on ``tag`` from whichever of ``sources``
        (group ranks; default every other member) sends first, ``src`` its group rank.

        ``out`` is as for ``recv``. No message is lost to the race: one not taken stays
        for the next receive (``netdist.collectives.p2p``). ``NetdistTimeoutError`` names
        the group, the tag and the sources when none sent within ``timeout``.
        """
        self._check_member("recv_any")
        if sources is None:
            sources = [r for r in range(self.world_size) if r != self._rank]
        peers = [self._peer(s, "recv_any source") for s in sources]
        if not peers or self._rank in peers or len(set(peers)) != len(peers):
            raise ValueError(f"recv_any sources must be other members, each once, got "
                             f"{peers} on group rank {self._rank}")
        wire_tag = self._p2p_tag(tag)
        deadline = _timeout_value(timeout, "timeout") or self._timeout
        into, staged = recv_landing(out, "recv_any")
        chan = Channel(self._transport, self._ranks, self._rank, wire_tag, deadline, "recv_any")

        async def body() -> Any:
            src, message = await recv_from_any(chan, peers, deadline, into)
            return src, recv_result(message, out, staged, "recv_any")

        return await self._p2p("recv_any", body, recv_from_any_limit(deadline, len(peers)),
                               -1, async_op)

