"""Gradient aggregators: average every rank's gradients, dense or compressed.

A ``GradientAggregator`` takes this rank's gradients and returns the average over all
ranks. Four implementations live here:

- ``LocalAggregator``: one process, no communication (API uniformity).
- ``AllReduceAggregator``: tensor fusion. Gradients are packed into buckets of about
  ``bucket_mb`` MiB (one contiguous buffer per bucket, allocated once and reused every
  step; gradients are visited in reverse order as DDP does, because backward produces the
  last layers' gradients first). Buckets are all-reduced with several in flight and the
  results are copied straight back into the caller's arrays. A gradient that fills a
  bucket on its own is all-reduced in place, with no copy at all. Two hundred small
  tensors therefore cost a couple of all-reduces, not two hundred (Horovod's tensor
  fusion, PyTorch DDP's gradient buckets). ``bucket_views()`` goes one step further and
  hands out the gradient storage inside the buckets, so nothing is copied at all (DDP's
  ``gradient_as_bucket_view``).
- ``Fp16AllReduceAggregator``: the same buckets in float16: half the bytes of float32.
- ``TopKAggregator``: each rank sends only the top-k entries of each gradient (plus
  error feedback) as index/value pairs in one all-gather; every rank scatters all ranks'
  pairs into dense zeros in rank order, so all ranks compute bitwise the same sum.

Overlap with backward (DDP style): ``session = aggregator.begin(like_grads)`` opens one
step's ``OverlapSession``; the backward pass calls ``session.ready(i, grad)`` (from any
thread) as each gradient becomes final, and a bucket's all-reduce is launched on the
aggregator's event loop as soon as all of its gradients are final; ``await
session.finish()`` returns what ``aggregate()`` would have, bitwise. ``aggregate()`` is
itself a session whose gradients are all final at once, so there is one mechanism.
``AllReduceAggregator`` and ``Fp16AllReduceAggregator`` support it; ``TopKAggregator``
(one all-gather of the whole compressed step) and the parameter-server aggregators do
not, and ``distributed_train_step(overlap=True)`` falls back to aggregating after
backward for them.

``bytes_sent`` counts the gradient payload this rank hands to the collectives (bucket
bytes, or index + value bytes). The algorithm's own traffic factor comes on top (a ring
all-reduce sends ``2 (n - 1) / n`` times its buffer, an all-gather ``n - 1`` times the
contribution); the payload is the figure compression changes.

Averaging uses ``ReduceOp.MEAN`` (sum, then one division by the group size) so the
result equals single-process training on the union of the ranks' batches up to rounding,
and every rank receives bitwise-identical averages.

Torch tensors. Gradients may be CPU torch tensors (``param.grad``) wherever arrays
are accepted (``aggregate``, ``begin``, ``ready``, ``finish``, ``bucket_views``): netdist
works on NumPy views of their memory (``netdist.tensors``), averages them in place and
returns the same tensors; ``bucket_views`` of tensors are tensors over the buckets. A
non-contiguous tensor is packed from and drained back into its strided memory, as a
non-contiguous array is. bfloat16 gradients (``torch.bfloat16``, or ``ml_dtypes``'
bfloat16) are averaged in bfloat16 buckets, with or without ``ml_dtypes``: summed
pairwise and divided as torch computes bfloat16 (``netdist.types``). The float16 variant
converts them to float16 and back; ``TopKAggregator`` selects, accumulates and sends
their values in float32 (so the error-feedback residual keeps float32 precision) and
rounds the average back to bfloat16.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from netdist.compression.fp16 import cast_to_fp16
from netdist.compression.topk import TopKCompressor, index_dtype
from netdist.errors import CollectiveError, CollectiveMismatchError
from netdist.tensors import as_array, to_tensor
from netdist.bfloat16 import cast_into, float32_to_bfloat16, widen_bfloat16
from netdist.call_markers import thread_safe
from netdist.types import CARRIED_DTYPES, ReduceOp, is_bfloat16

if TYPE_CHECKING:  # the collectives import asyncio; keep the type-only dependency lazy
    from netdist.collectives import Group

__all__ = [
    "GradientAggregator",
    "OverlapAggregator",
    "OverlapSession",
    "SessionState",
    "LocalAggregator",
    "AllReduceAggregator",
    "Fp16AllReduceAggregator",
    "TopKAggregator",
    "BucketEntry",
    "Bucket",
    "plan_buckets",
]

_MIB = 1 << 20


@runtime_checkable
class GradientAggregator(Protocol):
    """Averages gradients across the ranks of a job.

    ``aggregate`` must be called by every rank with gradients of the same shapes and
    dtypes in the same order; it returns the averages in that order (implementations
    may write them into the given arrays and return those). ``bytes_sent`` is the total
    gradient payload this rank has put on the wire so far.
    """

    @property
    def bytes_sent(self) -> int:
        """Total gradient payload bytes this rank has sent so far."""
        ...

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """Return the average over all ranks of each gradient."""
        ...


@runtime_checkable
class OverlapAggregator(Protocol):
    """A ``GradientAggregator`` that can overlap its communication with backward.

    ``begin(like)`` opens an ``OverlapSession`` for one step whose gradients have the
    shapes and dtypes of ``like`` (see ``OverlapSession``).
    """

    def begin(self, like: Sequence[np.ndarray]) -> OverlapSession:
        """Open one step's session; call it on the aggregator's event loop."""
        ...


def _grad_array(i: int, g: Any) -> np.ndarray:
    """Gradient ``i`` as an array: itself, or a NumPy view of a CPU tensor's memory."""
    if not isinstance(g, np.ndarray):
        try:
            g = as_array(g, f"gradient {i}", writeable=True)
        except TypeError:
            raise TypeError(f"gradient {i} is a {type(g).__name__}, expected a numpy array "
                            "or a CPU torch.Tensor") from None
    if g.dtype.kind != "f" and not is_bfloat16(g.dtype):
        raise TypeError(f"gradient {i} has dtype {g.dtype}; gradients must be floating point")
    return g


def _check_grads(grads: Sequence[Any]) -> tuple[list[np.ndarray], list[Any] | None]:
    """``(arrays, tensors)``: the gradients as arrays, and (if any was a tensor) the
    tensors by index (None where an array was given) to hand the results back as."""
    arrays = list(grads)
    tensors: list[Any] | None = None
    for i, g in enumerate(arrays):
        if not isinstance(g, np.ndarray):
            if tensors is None:
                tensors = [None] * len(arrays)
            tensors[i] = g
        arrays[i] = _grad_array(i, g)
    return arrays, tensors


def _as_given(results: list[np.ndarray], arrays: Sequence[np.ndarray],
              tensors: Sequence[Any] | None) -> list[Any]:
    """The results as the caller passed the gradients: a tensor's own tensor where the
    average was written into it, a tensor over a fresh result otherwise."""
    if tensors is None:
        return results
    return [r if t is None else (t if r is a else to_tensor(r))
            for r, a, t in zip(results, arrays, tensors)]


class LocalAggregator:
    """World size one: the gradients are already the average. Sends nothing."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.last_bytes_sent = 0
        self.steps = 0

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """Return ``grads`` unchanged (as a new list)."""
        _check_grads(grads)
        self.steps += 1
        return list(grads)


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """Gradient ``index`` occupies ``[offset, offset + size)`` of its bucket."""

    index: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One fused buffer: ``size`` elements of ``dtype`` holding ``entries`` back to back."""

    dtype: str
    size: int
    entries: tuple[BucketEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.size * key_dtype(self.dtype).itemsize


def dtype_key(dtype: Any) -> str:
    """A bucket's dtype as a string that round-trips through ``key_dtype``.

    ``dtype.str`` names the byte order, but for extension types such as ml_dtypes'
    bfloat16 it is only ``'<V2'`` (raw bytes), so those are named by their wire name.
    """
    dt = np.dtype(dtype)
    return "bfloat16" if dt.kind == "V" and is_bfloat16(dt) else dt.str


def key_dtype(key: str) -> np.dtype[Any]:
    """The dtype a ``dtype_key`` names (bfloat16: ``netdist.types.BFLOAT16``)."""
    return CARRIED_DTYPES[key] if key == "bfloat16" else np.dtype(key)


def plan_buckets(sizes: Sequence[int], dtypes: Sequence[Any], bucket_bytes: int, *,
                 reverse: bool = True) -> tuple[Bucket, ...]:
    """PURE: pack gradients into buckets of at least ``bucket_bytes`` (the last may be less).

    Gradients are visited in reverse order (``reverse=True``), each dtype filling its own
    open bucket; a bucket closes once it holds ``bucket_bytes`` or more, so a gradient
    larger than the cap gets a bucket of its own. Empty gradients are left out. The plan
    depends only on the sizes and dtypes, so every rank computes the same one and issues
    the same collectives in the same order.
    """
    if len(sizes) != len(dtypes):
        raise ValueError(f"{len(sizes)} sizes but {len(dtypes)} dtypes")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    order = range(len(sizes) - 1, -1, -1) if reverse else range(len(sizes))
    open_buckets: dict[str, list[BucketEntry]] = {}
    fill: dict[str, int] = {}
    closed: list[Bucket] = []
    for i in order:
        size = int(sizes[i])
        if size < 0:
            raise ValueError(f"gradient {i} has negative size {size}")
        if size == 0:
            continue
        dt = np.dtype(dtypes[i])
        key = dtype_key(dt)
        entries = open_buckets.setdefault(key, [])
        offset = fill.get(key, 0)
        entries.append(BucketEntry(i, offset, size))
        fill[key] = offset + size
        if fill[key] * dt.itemsize >= bucket_bytes:
            closed.append(Bucket(key, fill[key], tuple(entries)))
            del open_buckets[key]
            del fill[key]
    for key, entries in open_buckets.items():
        closed.append(Bucket(key, fill[key], tuple(entries)))
    return tuple(closed)


class AllReduceAggregator:
    """Bucketed (fused) all-reduce averaging over a ``Group``.

    ``bucket_mb`` is the bucket size in MiB; ``max_in_flight`` bounds how many bucket
    all-reduces run concurrently (the next bucket is packed while earlier ones travel).
    The averaged gradients are written into the caller's arrays, which are returned; a
    read-only gradient gets a fresh array instead. Buffers are allocated on the first
    call and whenever the gradients' shapes or dtypes change.

    If a collective fails (timeout, lost peer), the error propagates after the other
    in-flight buckets have finished or failed, and the caller's arrays hold a mix of
    averaged and local values: treat the step as lost. One call at a time: the buffers
    are shared between steps.
    """

    def __init__(self, group: Group, bucket_mb: float = 25, *, max_in_flight: int = 4,
                 timeout: float | None = None) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.group = group
        self.bucket_bytes = max(1, int(bucket_mb * _MIB))
        self.max_in_flight = int(max_in_flight)
        self.timeout = timeout
        self.bytes_sent = 0
        self.last_bytes_sent = 0
        self.steps = 0
        self._layout: tuple[tuple[tuple[int, ...], str], ...] | None = None
        self._plan: tuple[Bucket, ...] = ()
        self._buffers: list[np.ndarray | None] = []
        self._busy = False

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The current bucket plan (empty before the first ``aggregate``)."""
        return self._plan

    # Hooks the float16 variant overrides.
    def _wire_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        return dtype

    _op = ReduceOp.MEAN

    def _fill(self, target: np.ndarray, grad: np.ndarray) -> None:
        np.copyto(target, grad)

    def _drain(self, source: np.ndarray, grad: np.ndarray) -> None:
        np.copyto(grad, source, casting="same_kind")

    def _zero_copy_ok(self, bucket: Bucket, grads: list[np.ndarray]) -> bool:
        if len(bucket.entries) != 1:
            return False
        g = grads[bucket.entries[0].index]
        return (g.flags.c_contiguous and g.flags.writeable
                and dtype_key(g.dtype) == bucket.dtype and self._wire_dtype(g.dtype) == g.dtype)

    def _prepare(self, grads: list[np.ndarray]) -> None:
        layout = tuple((tuple(g.shape), g.dtype.str) for g in grads)
        if layout == self._layout:
            return
        wire = [self._wire_dtype(g.dtype) for g in grads]
        self._plan = plan_buckets([g.size for g in grads], wire, self.bucket_bytes)
        self._buffers = [None] * len(self._plan)
        self._layout = layout

    def bucket_views(self, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Zeroed gradient storage inside the buckets, one view per array of ``like``.

        Use the views as the gradients themselves (``param.grad = view``; backward
        passes add into them in place) and ``aggregate`` moves no bytes locally: each
        bucket is all-reduced where the gradients already are (PyTorch DDP's
        ``gradient_as_bucket_view``). Call it before the first ``aggregate``; the views
        stay valid while the gradients keep their shapes and dtypes. Tensors in ``like``
        get tensors over the bucket storage (``param.grad = view`` works as it is).
        """
        arrays, tensors = _check_grads(like)
        self._prepare(arrays)
        views: list[np.ndarray] = [np.zeros(g.shape, dtype=g.dtype) for g in arrays]
        for b, bucket in enumerate(self._plan):
            buf = self._buffer(b)
            buf[...] = 0
            for e in bucket.entries:
                views[e.index] = buf[e.offset:e.offset + e.size].reshape(arrays[e.index].shape)
        if tensors is None:
            return views
        return [v if t is None else to_tensor(v) for v, t in zip(views, tensors)]

    @staticmethod
    def _in_bucket(g: np.ndarray, buf: np.ndarray, e: BucketEntry) -> bool:
        """True if ``g`` is exactly the bucket's storage for entry ``e`` (a bucket view)."""
        return (g.dtype == buf.dtype and g.size == e.size and g.flags.c_contiguous
                and g.ctypes.data == buf.ctypes.data + e.offset * buf.itemsize)

    def _buffer(self, b: int) -> np.ndarray:
        buf = self._buffers[b]
        if buf is None:
            bucket = self._plan[b]
            buf = self._buffers[b] = np.empty(bucket.size, dtype=key_dtype(bucket.dtype))
        return buf

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """All-reduce-average ``grads`` across the group, bucket by bucket.

        A session whose gradients are all final at once: each bucket is packed on the
        event loop just before its all-reduce is launched, so packing bucket ``k + 1``
        overlaps with bucket ``k`` on the wire.
        """
        arrays, tensors = _check_grads(grads)
        session = self._open(arrays, pack_on_ready=False, tensors=tensors)
        for i in range(len(arrays)):
            session.ready(i)  # like[i]: the array, and the tensor it views if any
        return await session.finish()

    def begin(self, like: Sequence[np.ndarray]) -> OverlapSession:
        """Open an ``OverlapSession`` for one step whose gradients look like ``like``.

        Call it on the aggregator's event loop (in a coroutine, or through a ``Job``'s
        blocking proxy), before backward starts; then report each gradient with
        ``session.ready(i, grad)`` from any thread as soon as it is final, and ``await
        session.finish()``. ``like`` fixes the shapes and dtypes (and so the bucket
        plan); its arrays are the default gradients of ``ready(i)``. The aggregator is
        busy until the session finishes or is closed.
        """
        arrays, tensors = _check_grads(like)
        return self._open(arrays, pack_on_ready=True, tensors=tensors)

    def _open(self, arrays: list[np.ndarray], *, pack_on_ready: bool,
              tensors: list[Any] | None = None) -> OverlapSession:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise CollectiveError(
                "an aggregator step must start on the aggregator's event loop (inside a "
                "coroutine, or through a Job's blocking proxy); no loop is running in "
                f"thread {threading.current_thread().name!r}") from None
        if self._busy:
            raise CollectiveError("aggregate() or begin() called while a previous step on "
                                  "this aggregator is still running (its buffers are shared)")
        self.steps += 1
        if self.group.world_size > 1:
            self._prepare(arrays)
        self._busy = True
        try:
            return OverlapSession(self, arrays, loop, pack_on_ready=pack_on_ready,
                                  tensors=tensors)
        except BaseException:
            self._busy = False
            raise

    def _session_done(self, step_bytes: int | None) -> None:
        """Called once per session when it ends: release the buffers, count the bytes
        of a successful step (``step_bytes``; None for a failed or abandoned one)."""
        self._busy = False
        if step_bytes is not None:
            self.bytes_sent += step_bytes
            self.last_bytes_sent = step_bytes

    async def _launch(self, buf: np.ndarray) -> Any:
        return await self.group.all_reduce(buf, op=self._op, async_op=True,
                                           timeout=self.timeout)

    async def _finish(self, item: tuple[int, np.ndarray | None, Any],
                      arrays: list[np.ndarray], results: list[np.ndarray]) -> None:
        b, buf, work = item
        await work
        if buf is None:  # reduced in place in the caller's array
            return
        for e in self._plan[b].entries:
            g = arrays[e.index]
            if self._in_bucket(g, buf, e):
                continue  # reduced in place: the gradient is a view of the bucket
            view = buf[e.offset:e.offset + e.size].reshape(g.shape)
            if g.flags.writeable:
                self._drain(view, g)
            else:
                fresh = np.empty(g.shape, dtype=g.dtype)
                self._drain(view, fresh)
                results[e.index] = fresh


class SessionState(enum.Enum):
    """Where an ``OverlapSession`` is in its life."""

    OPEN = "open"
    """Gradients may be reported; buckets launch as they complete."""
    FINISHED = "finished"
    """``finish()`` returned the averages."""
    FAILED = "failed"
    """A bucket's all-reduce failed (lost peer, timeout); ``finish()`` raises its error."""
    CLOSED = "closed"
    """Abandoned by ``aclose()`` (or cancelled) before it finished."""


class OverlapSession:
    """One step of an ``AllReduceAggregator`` whose buckets launch while backward runs.

    Made by ``aggregator.begin(like)`` on the aggregator's event loop. Backward reports
    each gradient with ``ready(i, grad)`` as soon as it is final -- from any thread: the
    call does its bookkeeping under a lock and, when it completes a bucket, packs that
    bucket in the calling thread (as DDP's autograd hooks do) and hands it to the loop
    with ``loop.call_soon_threadsafe``. A driver task on the loop launches the buckets'
    all-reduces strictly in plan order (bucket ``k`` only after buckets ``< k``, even if
    it completed earlier), because collectives must be issued in the same order on every
    rank; at most ``max_in_flight`` run at once, and each is drained into the caller's
    arrays as it completes. ``await finish()`` returns the averaged gradients exactly as
    ``aggregate()`` would: the same buckets, the same ``MEAN``, bitwise the same values.

    A reported gradient belongs to the session until ``finish()`` returns: do not read
    or write it (its bucket may already be on the wire, or averaged into it). Report a
    gradient once per step, after its last accumulation.

    Failure: a bucket's collective error (``PeerLostError``, a timeout) is raised by
    ``finish()``; from then on ``ready()`` raises ``CollectiveError`` so that a backward
    still running stops at its next report. ``aclose()`` abandons the step (a backward
    that raised, a cancelled caller): no further bucket is launched, those in flight are
    cancelled and awaited, and the aggregator is released. The caller's arrays then hold
    a mix of averaged and local values, and this rank has issued fewer collectives than
    its peers: treat the step as lost on every rank and close the group (the peers then
    see ``PeerLostError``), as after any failed collective. Every session ends in
    ``finish()`` or ``aclose()`` (``async with`` does the latter): its driver task waits
    for reports until then.
    """

    def __init__(self, aggregator: AllReduceAggregator, like: list[np.ndarray],
                 loop: asyncio.AbstractEventLoop, *, pack_on_ready: bool,
                 tensors: list[Any] | None = None) -> None:
        """Use ``aggregator.begin(like)``; this runs on the loop with the plan prepared.
        ``tensors[i]`` is the tensor ``like[i]`` views (None: an array was given)."""
        self._agg = aggregator
        self._layout = [(g.shape, g.dtype) for g in like]
        self._like = like
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._pack_on_ready = pack_on_ready
        self._plan = aggregator.buckets if aggregator.group.world_size > 1 else ()
        self._bucket_of = [-1] * len(like)
        for b, bucket in enumerate(self._plan):
            for e in bucket.entries:
                self._bucket_of[e.index] = b
        self._remaining = [len(bucket.entries) for bucket in self._plan]
        self._packed = [False] * len(self._plan)
        self._in_place = [False] * len(self._plan)
        self._final = [asyncio.Event() for _ in self._plan]
        self._reported = [False] * len(like)
        self._grads: list[np.ndarray] = list(like)
        """The reported gradients (``like``'s arrays until reported)."""
        self._results: list[np.ndarray] = list(like)
        self._tensors: list[Any] | None = None if tensors is None else list(tensors)
        """Per gradient, the tensor it was given as (results go back as tensors)."""
        self._lock = threading.Lock()
        self._state = SessionState.OPEN
        self._error: BaseException | None = None
        self._launched = 0
        self._released = False
        self._driver = loop.create_task(self._drive(), name="netdist-overlap-session")
        self._driver.add_done_callback(self._release)

    # -- reporting (any thread) ----------------------------------------------------------

    @property
    def state(self) -> SessionState:
        """Where the session is (see ``SessionState``)."""
        return self._state

    @property
    def error(self) -> BaseException | None:
        """The collective error that failed the session, or None."""
        return self._error

    @property
    def launched(self) -> int:
        """How many buckets' all-reduces have been launched so far (in plan order)."""
        return self._launched

    @thread_safe
    def ready(self, index: int, grad: np.ndarray | None = None) -> None:
        """Mark gradient ``index`` final; ``grad`` defaults to ``like[index]``.

        Thread-safe, callable from any thread. Raises ``CollectiveMismatchError`` if
        ``grad``'s shape or dtype differs from ``like[index]``, and ``CollectiveError``
        for an index out of range, a second report of the same gradient, or a session
        that is no longer open (failed, finished or closed).
        """
        i = self._check_index(index)
        tensor = None
        if grad is not None and not isinstance(grad, np.ndarray):
            tensor = grad
        g = self._like[i] if grad is None else self._check_grad(i, grad)
        with self._lock:
            if self._state is not SessionState.OPEN:
                raise CollectiveError(self._not_open(f"gradient {i} reported ready"))
            if self._reported[i]:
                raise CollectiveError(f"gradient {i} reported ready twice in one step")
            self._reported[i] = True
            self._grads[i] = g
            self._results[i] = g
            if tensor is not None:
                if self._tensors is None:
                    self._tensors = [None] * len(self._layout)
                self._tensors[i] = tensor
            elif grad is not None and self._tensors is not None:
                self._tensors[i] = None
            b = self._bucket_of[i]
            if b < 0:
                return  # empty gradients take no part in the all-reduce
            self._remaining[b] -= 1
            complete = self._remaining[b] == 0
        if complete:
            if self._pack_on_ready:
                self._pack(b)
            self._signal(b)

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise CollectiveError(f"gradient index must be an int, got {type(index).__name__}")
        i = int(index)
        if not 0 <= i < len(self._layout):
            raise CollectiveError(f"gradient index {i} out of range: the session has "
                                  f"{len(self._layout)} gradients")
        return i

    def _check_grad(self, i: int, grad: Any) -> np.ndarray:
        if not isinstance(grad, np.ndarray):
            try:
                grad = as_array(grad, f"gradient {i}", writeable=True)
            except TypeError:
                raise CollectiveMismatchError(
                    f"gradient {i} is a {type(grad).__name__}, expected a numpy array "
                    "or a CPU torch.Tensor") from None
        shape, dtype = self._layout[i]
        if grad.shape != shape or grad.dtype != dtype:
            raise CollectiveMismatchError(
                f"gradient {i} has shape {grad.shape} and dtype {grad.dtype}, but the "
                f"session was begun with shape {shape} and dtype {dtype}")
        return grad

    def _not_open(self, what: str) -> str:
        if self._state is SessionState.FAILED:
            return f"{what} after the step's all-reduce failed: {self._error}"
        return f"{what} to an overlap session that is already {self._state.value}"

    def _pack(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into its buffer, or mark it for an in-place
        all-reduce, exactly as ``aggregate()`` always did (the same copies, so the same
        bits)."""
        agg, bucket, grads = self._agg, self._plan[b], self._grads
        if agg._zero_copy_ok(bucket, grads):
            self._in_place[b] = True
        else:
            buf = agg._buffer(b)
            for e in bucket.entries:
                g = grads[e.index]
                if not agg._in_bucket(g, buf, e):
                    agg._fill(buf[e.offset:e.offset + e.size].reshape(g.shape), g)
        self._packed[b] = True

    def _signal(self, b: int) -> None:
        """Wake the driver for bucket ``b`` (on the loop, whichever thread we are on)."""
        event = self._final[b]
        if threading.get_ident() == self._loop_thread:
            event.set()
            return
        try:
            self._loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop is closed: nobody will ever launch the bucket
            raise CollectiveError(f"bucket {b} completed after the aggregator's event "
                                  "loop was closed") from None

    # -- the driver (on the loop) --------------------------------------------------------

    async def _drive(self) -> int:
        """Launch the buckets in plan order as they complete; drain them as they finish.
        Returns the payload bytes handed to the collectives."""
        agg = self._agg
        pending: deque[tuple[int, np.ndarray | None, Any]] = deque()
        step_bytes = 0
        try:
            for b, bucket in enumerate(self._plan):
                await self._final[b].wait()
                if not self._packed[b]:
                    self._pack(b)  # aggregate(): packed here, while earlier buckets travel
                if self._in_place[b]:  # the caller's own array, reduced where it is
                    flat = self._grads[bucket.entries[0].index].reshape(-1)
                    pending.append((b, None, await agg._launch(flat)))
                else:
                    buf = agg._buffer(b)
                    pending.append((b, buf, await agg._launch(buf)))
                self._launched = b + 1
                step_bytes += bucket.nbytes
                if len(pending) >= agg.max_in_flight:
                    await agg._finish(pending.popleft(), self._grads, self._results)
            while pending:
                await agg._finish(pending.popleft(), self._grads, self._results)
        except asyncio.CancelledError:
            await _cancel_works([item[2] for item in pending])
            raise
        except Exception as exc:
            with self._lock:
                if self._state is SessionState.OPEN:
                    self._state = SessionState.FAILED
                    self._error = exc
            await _settle([item[2] for item in pending])
            raise
        return step_bytes

    def _release(self, _: object = None) -> None:
        """Release the aggregator once the driver has stopped, however it stopped: at the
        latest from the driver's done callback, at once where the session ends (a done
        callback runs one loop turn late, and the caller's next step may not wait)."""
        driver = self._driver
        if self._released or not driver.done():
            return
        self._released = True
        ok = not driver.cancelled() and driver.exception() is None
        self._agg._session_done(driver.result() if ok else None)

    # -- ending the step (on the loop) ---------------------------------------------------

    async def finish(self, grads: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Wait for every bucket and return the averaged gradients, as ``aggregate()``.

        ``grads`` (optional, the step's gradients in order) reports every gradient not
        reported yet, so a backward that reports only some still ends correctly. A
        gradient never reported raises ``CollectiveError`` (after closing the session).
        A collective's error (``PeerLostError``, ``NetdistTimeoutError``, ...) is raised
        here after the other in-flight buckets settled. If the caller is cancelled, the
        session is closed (see ``aclose``).
        """
        if grads is not None:
            arrays = list(grads)
            if len(arrays) != len(self._layout):
                await self.aclose()
                raise CollectiveMismatchError(
                    f"finish() got {len(arrays)} gradients; the session was begun with "
                    f"{len(self._layout)}")
            try:
                for i, g in enumerate(arrays):
                    if not self._reported[i] and self._state is SessionState.OPEN:
                        self.ready(i, g)
            except CollectiveMismatchError:
                await self.aclose()
                raise
        missing = [i for i, done in enumerate(self._reported) if not done]
        if missing and self._state is SessionState.OPEN:
            await self.aclose()
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise CollectiveError(
                f"finish(): {len(missing)} of {len(self._layout)} gradients were never "
                f"reported ready ({shown}); report each one, or pass the step's "
                "gradients to finish()")
        if self._state is SessionState.CLOSED:
            raise CollectiveError("finish() called on an overlap session that was closed")
        try:
            await self._driver
        except asyncio.CancelledError:
            self._close()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller was cancelled
            raise CollectiveError("the overlap session was closed while finish() "
                                  "waited for it") from None
        finally:
            self._release()
        with self._lock:
            self._state = SessionState.FINISHED
        return _as_given(self._results, self._grads, self._tensors)

    def _close(self) -> bool:
        """Mark the session closed (if still open) and cancel the driver; True if it was
        still running."""
        with self._lock:
            if self._state is SessionState.OPEN:
                self._state = SessionState.CLOSED
        if self._driver.done():
            return False
        self._driver.cancel()
        return True

    async def aclose(self) -> None:
        """Abandon the step: launch nothing more, cancel and await the buckets in flight,
        release the aggregator. Idempotent; a finished or failed session is left as it is.
        If this call is itself cancelled, the driver still winds down on its own."""
        self._close()
        await asyncio.wait([self._driver])
        if not self._driver.cancelled():
            self._driver.exception()  # retrieved: finish() is where it is reported
        self._release()

    async def __aenter__(self) -> OverlapSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (f"<OverlapSession {self._state.value}: {self._launched} of "
                f"{len(self._plan)} buckets launched>")


class Fp16AllReduceAggregator(AllReduceAggregator):
    """Bucketed all-reduce with float16 on the wire (Horovod's fp16 compression).

    Each gradient is scaled by ``1 / world_size`` and cast to float16 (saturating at
    +-65504) while packing, the buckets are summed in float16, and the result is cast
    back into the caller's arrays. Pre-scaling makes the float16 sum the mean, so it
    overflows only where the mean itself would. Costs half the bytes of float32 (a
    quarter of float64) and about three significant digits.
    """

    _op = ReduceOp.SUM

    def _wire_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        return np.dtype(np.float16)

    def _zero_copy_ok(self, bucket: Bucket, grads: list[np.ndarray]) -> bool:
        return False  # every gradient is scaled while packing

    @staticmethod
    def _in_bucket(g: np.ndarray, buf: np.ndarray, e: BucketEntry) -> bool:
        return False

    def bucket_views(self, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Not available: the float16 buckets cannot hold the gradients themselves."""
        raise TypeError("Fp16AllReduceAggregator packs float16 copies; bucket_views would "
                        "lose precision in the gradients themselves")

    def _fill(self, target: np.ndarray, grad: np.ndarray) -> None:
        cast_to_fp16(grad, scale=1.0 / self.group.world_size, out=target)

    def _drain(self, source: np.ndarray, grad: np.ndarray) -> None:
        cast_into(grad, source)


class TopKAggregator:
    """Sparse averaging: top-k of each gradient, all-gathered as index/value pairs.

    Each rank compresses its gradients with a ``TopKCompressor(ratio, error_feedback)``
    (what is not sent stays in the rank's residual for the next step), packs every
    tensor's ``int32``/``int64`` indices and values into one byte buffer, and takes part
    in one ``all_gather``. Every rank then adds all ranks' values into dense zeros in rank
    order and divides by the group size, so the averages are bitwise identical across
    ranks. Results are written into the caller's arrays (a read-only gradient gets a
    fresh array). ``momentum`` enables DGC's momentum correction in the compressor.
    """

    def __init__(self, group: Group, ratio: float = 0.01, error_feedback: bool = True, *,
                 momentum: float = 0.0, timeout: float | None = None) -> None:
        self.group = group
        self.compressor = TopKCompressor(ratio, error_feedback=error_feedback,
                                         momentum=momentum)
        self.timeout = timeout
        self.bytes_sent = 0
        self.last_bytes_sent = 0
        self.dense_bytes = 0
        """Bytes the same gradients would have cost uncompressed, for comparison."""
        self.steps = 0
        self._layout: tuple[tuple[tuple[int, ...], str], ...] | None = None
        self._segments: list[tuple[int, int, np.dtype[Any], int, np.dtype[Any]]] = []
        self._payload = np.empty(0, dtype=np.uint8)
        self._gathered = np.empty(0, dtype=np.uint8)
        self._accumulators: list[np.ndarray] = []
        self._busy = False

    def _prepare(self, grads: list[np.ndarray]) -> None:
        layout = tuple((tuple(g.shape), g.dtype.str) for g in grads)
        if layout == self._layout:
            return
        segments = []
        offset = 0
        for g in grads:
            k = self.compressor.count(g.size)
            idt = index_dtype(g.size)
            segments.append((offset, k, idt, offset + k * idt.itemsize, g.dtype))
            offset += k * (idt.itemsize + g.dtype.itemsize)
        self._segments = segments
        self._payload = np.empty(offset, dtype=np.uint8)
        self._gathered = np.empty(offset * self.group.world_size, dtype=np.uint8)
        self._accumulators = [np.empty(g.size, dtype=g.dtype) for g in grads]
        residuals = self.compressor.residuals
        if residuals and [(r.size, r.dtype) for r in residuals] != [(g.size, g.dtype)
                                                                 for g in grads]:
            self.compressor.reset()  # a new model; residuals restored for this one are kept
        self._layout = layout

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """Average the top-k-compressed gradients of all ranks."""
        arrays, tensors = _check_grads(grads)
        if self._busy:
            raise CollectiveError("aggregate() called while a previous call on this "
                                  "aggregator is still running (its buffers are shared)")
        self._busy = True
        try:
            return _as_given(await self._aggregate(arrays), arrays, tensors)
        finally:
            self._busy = False

    async def _aggregate(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        self.steps += 1
        work = [widen_bfloat16(g) for g in arrays]  # bfloat16 is selected and summed in float32
        self._prepare(work)
        world = self.group.world_size
        compressed = self.compressor.compress(work)
        payload = self._payload
        for (offset, k, idt, voff, _), cg in zip(self._segments, compressed):
            payload[offset:voff] = cg.indices.astype(idt, copy=False).view(np.uint8)
            payload[voff:voff + cg.values.nbytes] = cg.values.view(np.uint8)
        if world > 1:
            gathered = await self.group.all_gather(payload, out=self._gathered,
                                                   timeout=self.timeout)
            if gathered.size != payload.size * world:
                raise CollectiveError(
                    f"top-k all_gather returned {gathered.size} bytes, expected "
                    f"{world} x {payload.size}: ranks disagree on the gradient layout")
        else:
            gathered = payload
        results = list(arrays)
        for i, ((offset, k, idt, voff, vdt), g) in enumerate(zip(self._segments, arrays)):
            acc = self._accumulators[i]
            acc[...] = 0
            for r in range(world):
                base = r * payload.size
                idx = gathered[base + offset:base + voff].view(idt)
                vals = gathered[base + voff:base + voff + k * vdt.itemsize].view(vdt)
                acc[idx] += vals  # indices are unique within one rank's contribution
            target = acc.reshape(g.shape)
            if g.dtype.kind == "V":  # bfloat16: the float32 average, rounded once
                np.divide(target, world, out=target)
                if g.flags.writeable:
                    float32_to_bfloat16(target, out=g)
                else:
                    results[i] = float32_to_bfloat16(target)
            elif g.flags.writeable:
                np.divide(target, world, out=g)
            else:
                results[i] = target / world
        self.last_bytes_sent = payload.nbytes if world > 1 else 0
        self.bytes_sent += self.last_bytes_sent
        self.dense_bytes += sum(g.nbytes for g in arrays) if world > 1 else 0
        return results


async def _cancel_works(works: Sequence[Any]) -> None:
    """Cancel collectives in flight and wait until they have stopped, so none writes
    into a buffer after its step was abandoned. Their outcomes are dropped."""
    for work in works:
        work.cancel()
    waiters = [asyncio.ensure_future(work.wait()) for work in works]
    if waiters:
        await asyncio.wait(waiters)
    for waiter in waiters:
        if not waiter.cancelled():
            waiter.exception()


async def _settle(works: Any) -> None:
    """After a failure, wait for the other in-flight collectives so none is left running
    unobserved; their own errors are dropped (the first error is already propagating).
    Each collective is bounded by its timeout. Cancellation is not swallowed."""
    for work in list(works):
        try:
            await work
        except Exception:  # noqa: BLE001
            pass

