"""``Group``: collectives among an ordered set of ranks of one transport.

A group is an ordered set of transport ranks. Every rank of the group must call the same
collectives in the same order (as with NCCL and Gloo); each call takes the next tag from
a per-group counter (``netdist.collectives.tags``), so calls issued in the same order
match up even when several are in flight (``async_op=True``). Group ids are
deterministic: the n-th ``Group(transport)`` created on a transport and the k-th child
created by ``new_group`` hash to the same id on every rank, provided every rank creates
groups in the same order.

``Group`` is a facade. It owns membership and subgroups, tags, the call's deadline and
error context, and the tasks of ``async_op=True`` calls (``Work``); each collective
method hands its arguments to its family in ``netdist.collectives.ops``, which checks
them, asks ``netdist.collectives.routes`` (the only place an algorithm is chosen) for the
route, and returns the body that runs it. Reduction semantics and torch tensors: see
``netdist.collectives.ops``; algorithms: ``netdist.collectives.routes``.

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
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError, ScratchPool
from netdist.collectives.host.layout import LocalMode
from netdist.collectives.host.lane import LanePath
from netdist.collectives.host.arena import DEFAULT_SLOT_BYTES, HostPath
from netdist.collectives.algorithms.barrier import root_monitored_limit
from netdist.collectives.ops import all_reduce as _all_reduce
from netdist.collectives.ops import exchange, p2p, rooted, scatter_gather
from netdist.collectives.ops.arguments import subgroup_ranks, timeout_value
from netdist.collectives.ops.context import OpContext, spans_hosts
from netdist.collectives.routes import (
    DEFAULT_PIPELINE_DEPTH,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_MESSAGE_BYTES,
    Tuning,
)
from netdist.collectives.tags import (
    P2P_TAG_LIMIT,
    SEQ_MASK,
    SEQ_SHIFT,
    TagRange,
    group_id as make_group_id,
    group_tag_base,
    next_root_group,
    reserve_tags,
)
from netdist.collectives.calls import Calls
from netdist.collectives.mesh import DeviceMesh, MeshDims
from netdist.collectives.work import EagerStart, Work
from netdist.errors import (
    CollectiveError,
    LocalProtocolError,
    NetdistTimeoutError,
    NotInGroupError,
    PeerLostError,
    TransportClosedError,
)
from netdist.transport.base import Transport
from netdist.collectives.host.settings import ShmCopy, shared_memory_copy, shared_memory_enabled
from netdist.call_markers import eager_start
from netdist.types import ReduceOp

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Group", "P2P_TAG_LIMIT", "TagRange"]

T = TypeVar("T")
ArrayT = TypeVar("ArrayT", np.ndarray, "Tensor")
"""An array-valued collective returns what it was given: NumPy in, NumPy out; torch in,
torch out (``out=`` must then be of the same kind)."""
OutputsT = TypeVar("OutputsT", bound="Sequence[np.ndarray | Tensor]")
Op = ReduceOp | str
F = Literal[False]
Tr = Literal[True]


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
                 pipeline_depth: int = DEFAULT_PIPELINE_DEPTH,
                 shared_memory: bool | None = None,
                 shm_slot_bytes: int = DEFAULT_SLOT_BYTES,
                 shm_copy: ShmCopy | str | None = None) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"Group needs a Transport, got {type(transport).__name__}")
        if not isinstance(shm_slot_bytes, int) or shm_slot_bytes < 4096:
            raise ValueError(f"shm_slot_bytes must be an int >= 4096, got {shm_slot_bytes!r}")
        timeout = timeout_value(timeout, "timeout")
        self._setup(transport, tuple(range(transport.world_size)),
                    make_group_id("root", next_root_group(transport)),
                    float(transport.timeout) if timeout is None else timeout,
                    Tuning(small_message_bytes, segment_bytes, pipeline_depth),
                    shared_memory_enabled(shared_memory), -(-shm_slot_bytes // 64) * 64,
                    shared_memory_copy(shm_copy))

    def _setup(self, transport: Transport, ranks: tuple[int, ...], gid: int, timeout: float,
               tuning: Tuning, shared_memory: bool, shm_slot_bytes: int,
               shm_copy: ShmCopy) -> None:
        self._transport, self._ranks, self._gid, self._timeout = transport, ranks, gid, timeout
        self._rank = ranks.index(transport.rank) if transport.rank in ranks else -1
        self._tag_base = group_tag_base(gid)
        self._tuning = tuning
        self.shared_memory = shared_memory
        """Whether this rank offers shared memory to ranks on its host (all must)."""
        self.shm_copy = shm_copy
        """How this rank offers to move an all-reduce on one host (all must agree)."""
        self._ops = OpContext(transport, ranks, self._rank, tuning,
                              HostPath(shared_memory, shm_slot_bytes, shm_copy),
                              LanePath(shared_memory), timeout, self._tag_base,
                              spans_hosts(transport, ranks))
        self._seq = self._children = 0
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._scratch = ScratchPool()
        self._recorder = transport.recorder
        self._recorder.register_group(gid, ranks)
        self._calls = Calls(transport, ranks, self._describe())
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

    @property
    def small_message_bytes(self) -> int:
        """Messages up to this size use the latency-optimal algorithms (all ranks alike)."""
        return self._tuning.small_message_bytes

    @small_message_bytes.setter
    def small_message_bytes(self, value: int) -> None:
        self._tuning.small_message_bytes = value

    @property
    def segment_bytes(self) -> int:
        """Largest pipeline segment of the ring and chain algorithms."""
        return self._tuning.segment_bytes

    @property
    def pipeline_depth(self) -> int:
        """Scratch segments the in-place ring all-reduce rotates through."""
        return self._tuning.pipeline_depth

    def reserve_tags(self, owner: str) -> TagRange:
        """Reserve a range of ``2**32`` transport tags for ``owner`` among this group's ranks.

        For layers above the collectives that talk point to point on their own tags (the
        pipeline, the parameter server): the range is apart from application tags and
        from every group's collectives, and the n-th reservation of ``owner`` names the
        same tags on every member, so members reserve in the same order (see
        ``netdist.collectives.tags.reserve_tags``).
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
        members = subgroup_ranks(ranks, self.world_size)
        if name is None:
            gid = make_group_id("child", self._gid, self._children, tuple(members))
            self._children += 1
        else:
            gid = make_group_id("named", self._gid, str(name), tuple(members))
        child = Group.__new__(Group)
        child._setup(self._transport, tuple(self._ranks[r] for r in members), gid,
                     self._timeout, dataclasses.replace(self._tuning), self.shared_memory,
                     self._ops.host.slot_bytes, self.shm_copy)
        self._subgroups.append(child)
        return child

    def next_child_index(self) -> int:
        """Take the next index of this group's collectively made children (the counter
        ``new_group`` without ``name`` uses), for layers that make families of named
        subgroups collectively, such as a ``DeviceMesh``: the n-th call returns the same
        index on every member that calls in the same order."""
        index = self._children
        self._children += 1
        return index

    async def new_mesh(self, shape: MeshDims, names: Sequence[str] | None = None, *,
                       timeout: float | None = None) -> DeviceMesh:
        """Arrange this group's ranks in a grid of named dimensions (collective):
        ``await group.new_mesh({"dp": 2, "tp": 2})``. See ``netdist.collectives.mesh``."""
        self._check_member("new_mesh")
        return await DeviceMesh.create(self, shape, names, timeout=timeout)

    # -- lifecycle -----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel collectives still running from ``async_op=True`` (this group and its
        subgroups) and wait for them to finish. Idempotent; the transport stays open."""
        self._closed = True
        tasks = self._calls.cancel()
        for child in self._subgroups:
            await child.aclose()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._scratch.clear()
        self._ops.host.close()
        self._ops.lane.close()

    def close(self) -> None:
        """Cancel outstanding work without waiting (prefer ``aclose``)."""
        self._closed = True
        self._calls.cancel()
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

    def _channel(self, op: str, timeout: float | None, nbytes: int = 0) -> Channel:
        """The channel of the next collective call: it takes the next tag, in issue order,
        and the call's flight record (``nbytes``: its payload, 0 where unknown)."""
        deadline = timeout_value(timeout, "timeout")
        seq = self._seq
        tag = self._tag_base | (seq << SEQ_SHIFT)
        self._seq = (seq + 1) & SEQ_MASK
        chan = Channel(self._transport, self._ranks, self._rank, tag,
                       self._timeout if deadline is None else deadline, op, self._plans,
                       self._scratch)
        chan.record = self._recorder.begin(self._gid, seq, op, self._rank, nbytes,
                                           self._ops.take_planned())
        return chan

    async def _submit(self, op: str, body: Callable[[Channel], Awaitable[T]],
                      timeout: float | None, async_op: bool, nbytes: int = 0) -> T | Work:
        """Allocate the next tag now (issue order), then run ``body`` or hand out a Work."""
        chan = self._channel(op, timeout, nbytes)
        if not async_op:
            return await self._calls.run(chan, body)
        return self._calls.launch(chan, body)

    async def _p2p(self, op: str, prepared: p2p.Prepared, async_op: bool) -> Any:
        """Run a point-to-point call (no collective tag) under its deadline."""
        deadline, peer, body = prepared
        chan = Channel(self._transport, self._ranks, self._rank, 0, deadline, op)
        chan.waiting_on = peer

        async def run(_: Channel) -> Any:
            return await body()

        return await self._calls.run(chan, run) if not async_op else self._calls.launch(chan, run)

    @property
    def has_lane(self) -> bool | None:
        """Whether small all-reduces pass through shared memory (every rank on this
        host, shared memory on, x86-64); ``None`` until the first one has run."""
        return self._ops.lane.lane is not None if self._ops.lane.decided else None

    @property
    def local_mode(self) -> LocalMode | None:
        """How large collectives move data (``None`` until the first one has run)."""
        layout = self._ops.host.layout
        if layout is None:
            return None
        return LocalMode.TCP if self._ops.host.arena is None else layout.mode

    @property
    def local_copy(self) -> ShmCopy | None:
        """How large collectives move bytes among a host's ranks: ``SINGLE`` (ranks read
        and write each other's arrays; across hosts the two-level schedules run) or
        ``STAGED`` (through the segment); ``None`` until the first large collective, or
        when it does not use shared memory."""
        arena = self._ops.host.arena
        return None if arena is None else arena.copy

    # -- collectives (arguments checked and routes chosen in ``ops``) --------------------

    @overload
    async def all_reduce(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                         timeout: float | None = None, async_op: F = False) -> ArrayT: ...
    @overload
    async def all_reduce(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                         timeout: float | None = None, async_op: Tr) -> Work: ...
    @overload
    async def all_reduce(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                         timeout: float | None = None, async_op: bool) -> ArrayT | Work: ...
    @eager_start("all_reduce_eager")
    async def all_reduce(self, array: np.ndarray | Tensor, op: Op = ReduceOp.SUM, *,
                         timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks, in place; returns ``array`` (or a ``Work``).
        Every rank must pass the same shape and dtype."""
        self._check_member("all_reduce")
        body = _all_reduce.prepare_all_reduce(self._ops, array, op)
        return await self._submit("all_reduce", body, timeout, async_op, _nbytes(array))

    def all_reduce_eager(self, array: Any, op: Op = ReduceOp.SUM, *,
                         timeout: float | None = None,
                         async_op: bool = False) -> EagerStart | None:
        """Start ``all_reduce`` on this thread, without the event loop, where its route is
        the shared-memory lane (``ops.all_reduce.start_eagerly``); ``None``: not started,
        call ``all_reduce``. ``EagerStart.rest`` is ``None`` if the call finished here,
        else a coroutine to run on the loop, which finishes it under its deadline with
        ``all_reduce``'s errors. The blocking API calls it (``eager_start``)."""
        if async_op or self._closed or self._rank < 0:
            return None
        started = _all_reduce.start_eagerly(self._ops, array, op,
                                            lambda: self._channel("all_reduce", timeout,
                                                                  _nbytes(array)))
        if started is None:
            return None
        result, rest, chan = started
        if rest is None and chan.record is not None:
            self._recorder.end(chan.record, "ok")
        return EagerStart(result, None if rest is None else self._calls.run(chan, rest))

    @overload
    async def reduce_scatter(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: F = False) -> ArrayT: ...
    @overload
    async def reduce_scatter(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: Tr) -> Work: ...
    @overload
    async def reduce_scatter(self, array: ArrayT, op: Op = ReduceOp.SUM, *,
                             out: ArrayT | None = None, timeout: float | None = None,
                             async_op: bool) -> ArrayT | Work: ...
    async def reduce_scatter(self, array: np.ndarray | Tensor, op: Op = ReduceOp.SUM, *,
                             out: np.ndarray | Tensor | None = None,
                             timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks and return this rank's chunk of the result.

        ``array`` is flattened and split by ``chunk_bounds(array.size, world_size)`` (the
        first ``size % n`` chunks one element longer); this rank gets chunk ``rank`` as a
        1-D array, or in ``out`` (same dtype, exactly the chunk's number of elements).
        ``array`` itself is not modified. A tensor ``array`` gives a tensor result.
        """
        self._check_member("reduce_scatter")
        body = scatter_gather.prepare_reduce_scatter(self._ops, array, op, out)
        return await self._submit("reduce_scatter", body, timeout, async_op, _nbytes(array))

    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None, async_op: F = False) -> ArrayT: ...
    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None, async_op: Tr) -> Work: ...
    @overload
    async def all_gather(self, shard: ArrayT, *, out: ArrayT | None = None,
                         timeout: float | None = None, async_op: bool) -> ArrayT | Work: ...
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
        body = scatter_gather.prepare_all_gather(self._ops, shard, out)
        return await self._submit("all_gather", body, timeout, async_op, _nbytes(shard))

    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: F = False) -> ArrayT: ...
    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: Tr) -> Work: ...
    @overload
    async def broadcast(self, array: ArrayT, src: int, *, timeout: float | None = None,
                        async_op: bool) -> ArrayT | Work: ...
    async def broadcast(self, array: np.ndarray | Tensor, src: int, *,
                        timeout: float | None = None, async_op: bool = False) -> Any:
        """Copy ``array`` from group rank ``src`` into ``array`` on every rank, in place."""
        self._check_member("broadcast")
        body = rooted.prepare_broadcast(self._ops, array, src)
        return await self._submit("broadcast", body, timeout, async_op, _nbytes(array))

    @overload
    async def reduce(self, array: ArrayT, dst: int, op: Op = ReduceOp.SUM, *,
                     timeout: float | None = None, async_op: F = False) -> ArrayT: ...
    @overload
    async def reduce(self, array: ArrayT, dst: int, op: Op = ReduceOp.SUM, *,
                     timeout: float | None = None, async_op: Tr) -> Work: ...
    @overload
    async def reduce(self, array: ArrayT, dst: int, op: Op = ReduceOp.SUM, *,
                     timeout: float | None = None, async_op: bool) -> ArrayT | Work: ...
    async def reduce(self, array: np.ndarray | Tensor, dst: int, op: Op = ReduceOp.SUM, *,
                     timeout: float | None = None, async_op: bool = False) -> Any:
        """Reduce ``array`` over all ranks into ``array`` on group rank ``dst``.

        Returns ``array``; on other ranks ``array`` is left unchanged.
        """
        self._check_member("reduce")
        body = rooted.prepare_reduce(self._ops, array, dst, op)
        return await self._submit("reduce", body, timeout, async_op, _nbytes(array))

    @overload
    async def gather(self, array: ArrayT, dst: int, *, timeout: float | None = None,
                     async_op: F = False) -> list[ArrayT] | None: ...
    @overload
    async def gather(self, array: ArrayT, dst: int, *, timeout: float | None = None,
                     async_op: Tr) -> Work: ...
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
        body = rooted.prepare_gather(self._ops, array, dst)
        return await self._submit("gather", body, timeout, async_op, _nbytes(array))

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
        body = rooted.prepare_scatter(self._ops, arrays, src, out)
        return await self._submit("scatter", body, timeout, async_op, _nbytes(out))

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
        body = exchange.prepare_all_to_all(self._ops, inputs, outputs)
        return await self._submit("all_to_all", body, timeout, async_op,
                                  sum(_nbytes(item) for item in inputs))

    @overload
    async def barrier(self, *, timeout: float | None = None, async_op: F = False) -> None: ...
    @overload
    async def barrier(self, *, timeout: float | None = None, async_op: Tr) -> Work: ...
    @overload
    async def barrier(self, *, timeout: float | None = None,
                      async_op: bool) -> None | Work: ...
    async def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Wait until every member has entered the barrier (dissemination, no root)."""
        self._check_member("barrier")
        return await self._submit("barrier", exchange.prepare_barrier(self._ops), timeout,
                                  async_op)

    async def monitored_barrier(self, *, timeout: float | None = None,
                                wait_all_ranks: bool = False, async_op: bool = False) -> Any:
        """A barrier through group rank 0 that names the ranks that did not arrive within
        ``timeout`` (rank 0 raises ``NetdistTimeoutError`` naming the first, or every one
        with ``wait_all_ranks``; the others then fail too): Gloo's ``monitoredBarrier``,
        ``netdist.collectives.algorithms.barrier``. As there, ``timeout=0`` gives rank 0 no time."""
        self._check_member("monitored_barrier")
        seconds = 0.0 if timeout == 0 else self._ops.deadline(timeout)
        body = exchange.prepare_monitored_barrier(self._ops, seconds, wait_all_ranks)
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
        body = exchange.prepare_all_gather_object(self._ops, obj)
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
        body = exchange.prepare_broadcast_object(self._ops, obj, src)
        return await self._submit("broadcast_object", body, timeout, async_op)

    # -- point to point ------------------------------------------------------------------

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
        return await self._p2p("send", p2p.prepare_send(self._ops, array, dst, tag, timeout),
                               async_op)

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
        return await self._p2p("recv", p2p.prepare_recv(self._ops, src, tag, out, timeout),
                               async_op)

    async def recv_any(self, sources: Sequence[int] | None = None, tag: int = 0, *,
                       out: np.ndarray | Tensor | None = None, timeout: float | None = None,
                       async_op: bool = False) -> Any:
        """``(src, message)``: the next message on ``tag`` from whichever of ``sources``
        (group ranks; default every other member) sends first, ``src`` its group rank.

        ``out`` is as for ``recv``. No message is lost to the race: one not taken stays
        for the next receive (``netdist.collectives.ops.p2p``). ``NetdistTimeoutError`` names
        the group, the tag and the sources when none sent within ``timeout``.
        """
        self._check_member("recv_any")
        prepared = p2p.prepare_recv_any(self._ops, sources, tag, out, timeout)
        return await self._p2p("recv_any", prepared, async_op)


def _nbytes(array: Any) -> int:
    """The payload size a flight record notes for ``array`` (0 for ``None``)."""
    return int(getattr(array, "nbytes", 0) or 0)
