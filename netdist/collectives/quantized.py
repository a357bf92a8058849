"""Quantized all-reduce and reduce-scatter: int8 / int4 codes with per-chunk scales on
the wire, optional error feedback, and bitwise-identical results on every rank.

::

    reducer = QuantizedReducer(group, "int8", error_feedback=True)
    await reducer.all_reduce(grads, op=ReduceOp.MEAN, key="layer1.weight")

Formats, rounding and the error bound of one quantization: ``netdist.compression.quantize``.

**Flat algorithm** (one host, or ``hierarchical=False``, or hosts of unequal sizes), on a
group of ``m`` ranks and a float32 array of ``N`` elements:

1. Shards: shard ``j`` is ``chunk_bounds(N, m)[j]``, the split ``Group.reduce_scatter``
   uses; group rank ``j`` owns it. Every rank adds its residual under ``key`` (error
   feedback) and quantizes each shard on its own, so chunks start at shard boundaries
   (a shard's last chunk may be short).
2. ``all_to_all``: shard ``j``'s bytes go to rank ``j``.
3. The owner decodes the ``m`` contributions and sums them in float32 in group rank
   order, ``((y_0 + y_1) + y_2) + ...``, element by element; for MEAN it then divides
   once by ``m`` (``netdist.reduce_kernels.divide_into``, as ``ReduceOp.MEAN`` does
   elsewhere). ``reduce_scatter`` returns this float32 result on the owner, not
   re-quantized.
4. ``all_reduce`` only: the owner adds its own residual under ``key + ":reduced"`` (error
   feedback), quantizes its reduced shard, and ``all_gather`` brings every owner's bytes
   to every rank, which decodes them into the output. Every rank, owner included,
   decodes the same bytes with the same code, so **every rank's result is bitwise
   identical**.

**Hierarchical algorithm** (default when the group spans two or more hosts with the
same number, two or more, of ranks each; ``H`` hosts of ``L`` ranks, ``n = H * L``):
only bytes that cross hosts are quantized, and every local rank carries its share.

1. The array is padded to ``n`` world shards of ``S = ceil(N / n)`` elements (world
   shard ``r`` is ``chunk_bounds(N, n)[r]``, zero-padded) and laid out lane-major: the
   shard of the rank of local index ``l`` on host ``h`` sits at slot ``l * H + h``.
2. Inside each host, an exact float32 ``reduce_scatter`` (``SUM``, the host group's own)
   gives local rank ``l`` the ``H`` slots of its lane: the host's exact sums of the
   world shards of the ranks of local index ``l``.
3. Across hosts, among the ranks of equal local index (one per host, in host order), the
   flat algorithm runs on those ``H`` shards (unpadded): world shard ``r`` is owned by
   rank ``r`` itself. MEAN divides by ``n``, the whole group's size.
4. ``all_reduce`` only: an exact ``all_gather`` inside each host assembles the slots and
   they are put back in order.

So the result is ``Q(sum over hosts h, in host order, of Q_h(exact float32 sum on host
h))``, where ``Q_h`` is host ``h``'s lane rank's quantization of its partial sum and
``Q`` the owner's re-quantization; bitwise identical on every rank, because every value
of the output was decoded from the owner's bytes by the same code on every rank of its
lane and then copied unchanged by the host's all-gather. The order and rounding of the
exact sum inside a host follow the host group's reduce-scatter route and do not affect
that identity.

**Error feedback** (``error_feedback=True``): per ``key``, this rank's residual is what
it quantized minus what its sent bytes decode to (in the hierarchical algorithm: of its
lane's partial sums, the ``H`` slots it sends across hosts); the owner's residual under
``key + ":reduced"`` is its reduced shard minus what its re-quantized bytes decode to.
Residuals change only when a call succeeds. Over ``K`` calls with error feedback the
results sum to the exact sums minus what the residuals still hold, so their mean
converges to the exact mean as ``1/K``.

**Failures.** Every network step runs under one deadline (``timeout``, default the
group's). A value out of the quantizable range (NaN, inf, beyond ``+-2**126``, in an
input or in a reduced sum) does not stop the exchange: its shard travels as a poisoned
buffer (NaN scales), and ``all_reduce`` raises ``QuantizationError`` on every rank,
naming the owners of the shards it spoiled; ``reduce_scatter`` raises it on the ranks
whose input or contribution was out of range and on the owners of the shards it
reached. The output array and the residuals are then unchanged. Other failures are the
group's (``NetdistTimeoutError``, ``PeerLostError``, ...), which leave the group broken
as any failed collective does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from netdist.collectives.group import Group
from netdist.collectives.host.layout import HostLayout, LocalMode
from netdist.collectives.ops.arguments import timeout_value
from netdist.compression.quantize import (
    MAX_MAGNITUDE,
    ErrorFeedback,
    Quantization,
    try_quantize,
    dequantize,
    is_poisoned,
    poisoned_buffer,
)
from netdist.errors import ConfigError, NetdistTimeoutError, NotInGroupError, QuantizationError
from netdist.reduce_kernels import divide_into
from netdist.sharding import chunk_bounds
from netdist.tensors import as_array, is_tensor
from netdist.types import ReduceOp

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["QuantizedReducer", "REDUCED_SUFFIX"]

ArrayT = TypeVar("ArrayT", np.ndarray, "Tensor")

REDUCED_SUFFIX = ":reduced"
"""Appended to a key for the owner's residual of its re-quantized reduced shard."""

Bounds = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class _Hierarchy:
    """This rank's two subgroups and the lane-major layout of the hierarchical path."""

    layout: HostLayout
    local: Group
    lane: Group


@dataclass(slots=True)
class _Exchanged:
    """What the quantized exchange left on this rank."""

    reduced: np.ndarray  # the owned shard's float32 result (MEAN: divided)
    input_bad: bool  # this rank's contribution was out of range
    from_ranks: list[int]  # members whose contribution to the owned shard was poisoned
    bad_owners: list[int]  # all_reduce: members whose re-quantized shard was poisoned
    records: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    """Error-feedback residuals to record once the whole call has succeeded."""


class QuantizedReducer:
    """Quantized all-reduce and reduce-scatter over ``group`` (see the module docstring
    for the algorithms and the exact result).

    ``quantization`` is a ``Quantization`` or its text (``"int8"``, ``"int4:absmax:256"``).
    ``error_feedback`` keeps residuals per ``key`` (``self.feedback``, an
    ``ErrorFeedback``; ``state_dict()`` saves them). ``hierarchical`` allows the two-level
    path where the group's hosts have equal rank counts >= 2; the choice (``self.path``)
    is made here, from the host keys the transport learnt at rendezvous, and the two
    subgroups it needs are made here too, with ``group.new_group``: construct reducers
    on every member of the group in the same order relative to its other ``new_group``
    calls. ``timeout`` bounds each call as a whole (default: the group's timeout).
    ``bytes_sent`` counts the quantized payload bytes this rank sent (its all-to-all
    parts for the other members plus ``members - 1`` copies of its all-gather share, what
    a direct exchange or a ring moves per rank); the float32 traffic inside a host of
    the hierarchical path is not in it.
    """

    def __init__(self, group: Group, quantization: Quantization | str = Quantization(), *,
                 error_feedback: bool = False, hierarchical: bool = True,
                 timeout: float | None = None) -> None:
        if not isinstance(group, Group):
            raise TypeError(f"QuantizedReducer needs a Group, got {type(group).__name__}")
        if isinstance(quantization, str):
            quantization = Quantization.parse(quantization)
        elif not isinstance(quantization, Quantization):
            raise TypeError(f"quantization must be a Quantization or its text, "
                            f"got {type(quantization).__name__}")
        self.group = group
        self.quantization = quantization
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback()
        self.timeout = timeout_value(timeout, "QuantizedReducer timeout")
        self.bytes_sent = 0
        self._hierarchy = self._make_hierarchy() if hierarchical and group.is_member else None

    @property
    def path(self) -> str:
        """``"hierarchical"`` or ``"flat"``: the algorithm this reducer runs."""
        return "flat" if self._hierarchy is None else "hierarchical"

    def _make_hierarchy(self) -> _Hierarchy | None:
        group = self.group
        keys = group.transport.host_keys()
        if keys is None or group.world_size < 4:
            return None
        layout = HostLayout.from_keys([keys[r] for r in group.ranks],
                                      [True] * group.world_size, group.rank)
        if layout.mode is not LocalMode.HIERARCHICAL:
            return None
        # new_group is collective by order: every member makes every host's and every
        # lane's group, in the same loop, and keeps its own two.
        hosts = [group.new_group(members) for members in layout.hosts]
        lanes = [group.new_group(layout.lane(index)) for index in range(layout.lanes)]
        return _Hierarchy(layout, hosts[layout.host], lanes[layout.local])

    def state_dict(self) -> dict[str, np.ndarray]:
        """The error-feedback residuals (``self.feedback.state_dict()``)."""
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by ``state_dict``."""
        self.feedback.load_state_dict(state)

    # -- public collectives --------------------------------------------------------------

    async def all_reduce(self, array: ArrayT, op: ReduceOp | str = ReduceOp.SUM, *,
                         key: str = "default") -> ArrayT:
        """Reduce float32 ``array`` (NumPy, or a CPU torch tensor) over the group, in
        place, quantized on the wire; returns ``array``. ``op`` is SUM or MEAN. Every
        rank gets the same bits. ``key`` names the error-feedback residual (one per
        tensor). On failure ``array`` and the residuals are unchanged."""
        what = "QuantizedReducer.all_reduce"
        reduce_op = _reduce_op(op, what)
        view, flat, copied = _float32_flat(array, what, writeable=True)
        deadline = self._start(what)
        if not flat.size:
            return array
        divisor = self.group.world_size if reduce_op is ReduceOp.MEAN else 1
        if self._hierarchy is None:
            bounds = chunk_bounds(flat.size, self.group.world_size)
            done = await self._exchange(self.group, flat, bounds, key, divisor, deadline,
                                        decoded=flat)
            if done.bad_owners:
                raise QuantizationError(_spoiled_message(what, key, done.bad_owners, done,
                                                         self.group.rank))
            self._commit(done)
        else:
            flat[...] = await self._two_level_all_reduce(self._hierarchy, flat, key,
                                                         divisor, deadline)
        if copied:
            view[...] = flat.reshape(view.shape)
        return array

    async def reduce_scatter(self, array: np.ndarray | Tensor,
                             op: ReduceOp | str = ReduceOp.SUM, *,
                             key: str = "default") -> np.ndarray:
        """This rank's shard (``chunk_bounds(array.size, world_size)[rank]``, as
        ``Group.reduce_scatter`` splits) of the reduction of float32 ``array`` over the
        group: the owner's float32 sum of the decoded contributions (MEAN: divided once),
        not re-quantized. ``array`` is not modified. Returns a new float32 NumPy array."""
        what = "QuantizedReducer.reduce_scatter"
        reduce_op = _reduce_op(op, what)
        _, flat, _ = _float32_flat(array, what, writeable=False)
        deadline = self._start(what)
        if not flat.size:
            return np.empty(0, np.float32)
        divisor = self.group.world_size if reduce_op is ReduceOp.MEAN else 1
        if self._hierarchy is None:
            bounds = chunk_bounds(flat.size, self.group.world_size)
            done = await self._exchange(self.group, flat, bounds, key, divisor, deadline)
        else:
            done = await self._two_level_reduce_scatter(self._hierarchy, flat, key, divisor,
                                                        deadline)
        _raise_scattered(done, what, key, self.group.rank)
        self._commit(done)
        return done.reduced

    # -- the algorithms ------------------------------------------------------------------

    async def _host_step(self, hierarchy: _Hierarchy, flat: np.ndarray,
                         deadline: _Deadline) -> tuple[np.ndarray, _LaneMajor]:
        """Steps 1 and 2 of the hierarchical algorithm: this rank's lane block (the
        host's exact sums of its lane's world shards) and the layout."""
        plan = _LaneMajor.of(hierarchy.layout, flat.size)
        padded = np.zeros(plan.padded_size, np.float32)
        for r, (lo, hi) in enumerate(plan.world):
            padded[plan.slot[r]:plan.slot[r] + hi - lo] = flat[lo:hi]
        block = await hierarchy.local.reduce_scatter(
            padded, ReduceOp.SUM, timeout=deadline.left("host reduce-scatter"))
        return block, plan

    async def _two_level_reduce_scatter(self, hierarchy: _Hierarchy, flat: np.ndarray,
                                        key: str, divisor: int,
                                        deadline: _Deadline) -> _Exchanged:
        block, plan = await self._host_step(hierarchy, flat, deadline)
        lane_ranks = hierarchy.layout.lane(hierarchy.layout.local)
        done = await self._exchange(hierarchy.lane, block, plan.lane_bounds(lane_ranks), key,
                                    divisor, deadline)
        done.from_ranks = [lane_ranks[j] for j in done.from_ranks]
        done.input_bad = done.input_bad or not _in_range(flat)
        return done

    async def _two_level_all_reduce(self, hierarchy: _Hierarchy, flat: np.ndarray, key: str,
                                    divisor: int, deadline: _Deadline) -> np.ndarray:
        block, plan = await self._host_step(hierarchy, flat, deadline)
        lane_ranks = hierarchy.layout.lane(hierarchy.layout.local)
        lane_bounds = plan.lane_bounds(lane_ranks)
        decoded = np.zeros(block.size, np.float32)
        done = await self._exchange(hierarchy.lane, block, lane_bounds, key, divisor,
                                    deadline, decoded=decoded)
        for j in done.bad_owners:  # NaN tells the host's other lanes, after the gather
            decoded[lane_bounds[j][0]:lane_bounds[j][1]] = np.nan
        full = np.empty(plan.padded_size, np.float32)
        await hierarchy.local.all_gather(decoded, out=full,
                                         timeout=deadline.left("host all-gather"))
        result = np.empty_like(flat)
        for r, (lo, hi) in enumerate(plan.world):
            result[lo:hi] = full[plan.slot[r]:plan.slot[r] + hi - lo]
        if np.isnan(full).any():  # decoding never gives NaN: a shard was spoiled
            spoiled = [r for r, (lo, hi) in enumerate(plan.world)
                       if hi > lo and np.isnan(result[lo:hi]).any()]
            done.from_ranks = [lane_ranks[j] for j in done.from_ranks]
            done.input_bad = done.input_bad or not _in_range(flat)
            raise QuantizationError(_spoiled_message("QuantizedReducer.all_reduce", key,
                                                     spoiled, done, self.group.rank))
        self._commit(done)
        return result

    async def _exchange(self, g: Group, data: np.ndarray, bounds: Bounds, key: str,
                        divisor: int, deadline: _Deadline,
                        decoded: np.ndarray | None = None) -> _Exchanged:
        """The flat algorithm among ``g``'s members on ``data`` (1-D float32), whose shard
        ``j`` (``bounds[j]``) member ``j`` owns: ``reduced`` is the owned shard's float32
        result. With ``decoded`` (all-reduce), every shard's re-quantized result is
        decoded into it, unless a shard was spoiled (``bad_owners``), and ``decoded`` may
        be ``data`` itself (it is read before it is written)."""
        q = self.quantization
        m, me = g.world_size, g.rank
        feedback = self.feedback if self.error_feedback else None
        sent_input = data if feedback is None else feedback.compensate(key, data)
        sends, input_bad = [], False
        for lo, hi in bounds:
            buf = try_quantize(sent_input[lo:hi], q)
            if buf is None:
                buf, input_bad = poisoned_buffer(hi - lo, q), True
            sends.append(buf)
        own_lo, own_hi = bounds[me]
        own = own_hi - own_lo
        received = [np.empty(q.wire_bytes(own), np.uint8) for _ in range(m)]
        await g.all_to_all(sends, received, timeout=deadline.left("all-to-all"))
        self.bytes_sent += sum(buf.size for j, buf in enumerate(sends) if j != me)

        reduced = np.full(own, np.nan, np.float32)
        from_ranks = [r for r, buf in enumerate(received) if is_poisoned(buf, own, q)]
        if not from_ranks:
            part = np.empty(own, np.float32)
            with np.errstate(over="ignore"):
                for r, buf in enumerate(received):  # ((y_0 + y_1) + y_2) + ...
                    dequantize(buf, own, q, out=reduced if r == 0 else part)
                    if r:
                        np.add(reduced, part, out=reduced)
                if divisor > 1:
                    divide_into(reduced, divisor)
        done = _Exchanged(reduced, input_bad, from_ranks, [])
        if decoded is None:
            if feedback is not None and not input_bad and not from_ranks:
                done.records.append((key, sent_input,
                                     _decode_all(sends, bounds, q, data.size)))
            return done

        owner_key = key + REDUCED_SUFFIX
        requantize_input = reduced if feedback is None or from_ranks else \
            feedback.compensate(owner_key, reduced)
        mine = None if from_ranks else try_quantize(requantize_input, q)
        if mine is None:
            mine = poisoned_buffer(own, q)
        widths = [q.wire_bytes(hi - lo) for lo, hi in bounds]
        width = max(widths)  # every share padded to the widest: no shape exchange
        share = np.zeros(width, np.uint8)
        share[:mine.size] = mine
        everyone = np.empty(m * width, np.uint8)
        await g.all_gather(share, out=everyone, timeout=deadline.left("all-gather"))
        self.bytes_sent += (m - 1) * width
        pieces = [everyone[j * width:j * width + widths[j]] for j in range(m)]
        done.bad_owners = [j for j, piece in enumerate(pieces)
                           if is_poisoned(piece, bounds[j][1] - bounds[j][0], q)]
        if done.bad_owners:
            return done
        sent_decoded = None if feedback is None else _decode_all(sends, bounds, q, data.size)
        for j, (lo, hi) in enumerate(bounds):
            dequantize(pieces[j], hi - lo, q, out=decoded[lo:hi])
        if sent_decoded is not None:
            done.records.append((key, sent_input, sent_decoded))
            done.records.append((owner_key, requantize_input, decoded[own_lo:own_hi].copy()))
        return done

    def _commit(self, done: _Exchanged) -> None:
        """Record the residuals of a call that succeeded on this rank."""
        for key, sent_input, sent_decoded in done.records:
            self.feedback.record(key, sent_input, sent_decoded)

    def _start(self, what: str) -> _Deadline:
        if not self.group.is_member:
            raise NotInGroupError(f"{what}: this rank is not a member of {self.group!r}")
        seconds = self.group.timeout if self.timeout is None else self.timeout
        return _Deadline(what, seconds)


@dataclass(frozen=True, slots=True)
class _LaneMajor:
    """The hierarchical layout of ``size`` elements: world shard ``r``
    (``world[r]``) padded to ``shard`` elements at ``slot[r]``, lane by lane."""

    world: Bounds
    slot: list[int]
    shard: int
    padded_size: int

    @classmethod
    def of(cls, layout: HostLayout, size: int) -> _LaneMajor:
        n, hosts = sum(len(m) for m in layout.hosts), len(layout.hosts)
        shard = -(-size // n)
        slot = [0] * n
        for h, members in enumerate(layout.hosts):
            for local, r in enumerate(members):
                slot[r] = (local * hosts + h) * shard
        return cls(chunk_bounds(size, n), slot, shard, n * shard)

    def lane_bounds(self, lane_ranks: tuple[int, ...]) -> Bounds:
        """The unpadded world shards of a lane block, one per host."""
        return [(j * self.shard, j * self.shard + self.world[r][1] - self.world[r][0])
                for j, r in enumerate(lane_ranks)]


class _Deadline:
    """One deadline for a whole call; ``left(step)`` is the time its next step gets."""

    def __init__(self, what: str, seconds: float) -> None:
        self.what, self.seconds = what, seconds
        self.end = asyncio.get_running_loop().time() + seconds

    def left(self, step: str) -> float:
        remaining = self.end - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise NetdistTimeoutError(f"{self.what}: its {self.seconds} s deadline passed "
                                      f"before the {step}")
        return remaining


def _decode_all(sends: list[np.ndarray], bounds: Bounds, q: Quantization,
                size: int) -> np.ndarray:
    """What this rank's sent shards decode to, as one array."""
    out = np.zeros(size, np.float32)
    for buf, (lo, hi) in zip(sends, bounds):
        dequantize(buf, hi - lo, q, out=out[lo:hi])
    return out


def _reduce_op(op: ReduceOp | str, what: str) -> ReduceOp:
    name = op.value if isinstance(op, ReduceOp) else str(op).lower()
    if name not in ("sum", "mean"):
        raise ConfigError(f"{what}: op must be SUM or MEAN (or 'sum' / 'mean'), got {op!r}")
    return ReduceOp(name)


def _in_range(x: np.ndarray) -> bool:
    """Every value of ``x`` quantizable (False for NaN: its comparisons are false)."""
    limit = np.float32(MAX_MAGNITUDE)
    return bool(x.min() >= -limit and x.max() <= limit)


def _float32_flat(array: Any, what: str, *,
                  writeable: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """``array`` as a NumPy array (a view of a torch tensor's memory), a flat
    C-contiguous float32 view of it, and whether that is a copy (``array`` is not
    contiguous: results are copied back)."""
    if isinstance(array, np.ndarray):
        view = array
    elif is_tensor(array):
        view = as_array(array, what, writeable=writeable)
    else:
        raise TypeError(f"{what} needs a float32 numpy.ndarray or CPU torch.Tensor, "
                        f"got {type(array).__name__}")
    if view.dtype != np.float32:
        raise TypeError(f"{what} needs float32, got {view.dtype}")
    if writeable and not view.flags.writeable:
        raise ValueError(f"{what}: the array is read-only (the result is written in place)")
    if view.flags.c_contiguous:
        return view, view.reshape(-1), False
    return view, np.ascontiguousarray(view).reshape(-1), True


def _raise_scattered(done: _Exchanged, what: str, key: str, rank: int) -> None:
    """reduce_scatter's failure on this rank, if its input or its shard was spoiled."""
    if not done.input_bad and not done.from_ranks:
        return
    parts = []
    if done.input_bad:
        parts.append(f"this rank's (group rank {rank}) contribution holds NaN, infinite or "
                     f"beyond +-2**126 values")
    if done.from_ranks:
        parts.append(f"the contributions of group rank(s) {done.from_ranks} to this rank's "
                     f"shard hold such values")
    raise QuantizationError(f"{what} (key {key!r}): " + "; ".join(parts)
                            + "; the other ranks' shards are unaffected")


def _spoiled_message(what: str, key: str, owners: list[int], done: _Exchanged,
                     rank: int) -> str:
    text = (f"{what} (key {key!r}): the reduced shards of group rank(s) {owners} hold NaN, "
            f"infinite or beyond +-2**126 values, which cannot be quantized")
    if done.input_bad:
        text += f"; this rank's (group rank {rank}) input holds such values"
    if done.from_ranks:
        text += f"; the contributions of group rank(s) {done.from_ranks} held them"
    return text + "; the array and the residuals are unchanged"
