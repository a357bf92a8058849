"""DDP communication hooks that move gradients with netdist: top-k, fp16/bf16, parameter server.

``torch.nn.parallel.DistributedDataParallel`` hands every gradient bucket to a
*communication hook* (``model.register_comm_hook(state, hook)``) and applies whatever
flat gradient the hook's future yields. The hooks here do that communication with
netdist, on a ``netdist.Job``'s progress thread, whatever backend DDP itself was built on
(``"gloo"`` or ``"netdist"``)::

    import netdist
    from netdist.torch.hooks import TopKHook, comm_hook

    dist.init_process_group("gloo")                 # or "netdist"
    model = DistributedDataParallel(net)
    job = netdist.connect()                          # RANK / WORLD_SIZE / ... as usual
    state = TopKHook(job, ratio=0.01)                # error feedback on by default
    model.register_comm_hook(state, comm_hook)       # or: state.register(model)
    for batch in data:
        loss_fn(model(batch)).backward()             # buckets travel while backward runs
        optimizer.step()
        print(state.stats.last_step.sent, state.stats.ratio)
    state.close()                                    # every rank, before job.close()
    job.close()

The states, and the netdist algorithm each one reuses (nothing here is a new algorithm):

- ``TopKHook(job, ratio)``: ``netdist.parallel.TopKAggregator`` -- each rank sends the
  ``ceil(ratio * n)`` largest-magnitude entries of every gradient as index/value pairs in
  one all-gather and every rank adds all ranks' pairs in rank order, so every rank gets
  the same bits; what is not sent stays in a per-parameter error-feedback residual
  (``netdist.compression.TopKCompressor``) and is added to the next step's gradient.
- ``Fp16Hook(job)``: ``netdist.parallel.Fp16AllReduceAggregator`` -- the bucket is scaled
  by ``1 / world_size``, cast to float16 (saturating at +-65504), summed in float16 by
  netdist's all-reduce and cast back: half the bytes of float32.
- ``Bf16Hook(job)``: the same aggregator with bfloat16 on the wire (float32's range, so no
  saturation; no extra package: without ``ml_dtypes`` netdist carries bfloat16 as its raw
  bits, ``netdist.types.BFLOAT16_RAW``, and rounds and sums it exactly as torch does).
- ``ParameterServerHook(job)``: ``netdist.ps.ParameterServer`` -- rank 0 sums every rank's
  bucket in rank order, divides by the world size and sends the average back; with two
  ranks that is bit for bit DDP's own average.
- ``BoundedStalenessHook(job, max_staleness=k)``: ``netdist.ps.ColocatedPS`` with
  ``max_staleness=k`` -- gradients go to parameter servers that apply them under the
  stale-synchronous rule, so a fast rank runs up to ``k`` steps ahead of a slow one
  instead of waiting for it every step (see the class for how the servers' updates
  become DDP gradients).

How a hook runs. DDP calls the hook from its autograd thread as each bucket becomes
ready, in bucket order. The hook submits the bucket's coroutine to the job's progress
thread and returns a ``torch.futures.Future`` at once, so backward carries on computing
the next buckets while this one travels; the progress thread completes the future
(``set_result`` is thread-safe) and DDP waits for all of them at the end of backward.
The coroutines of one state run one after another in the order DDP called the hook,
whatever order the threads happen to schedule them in, because netdist's collectives
must be issued in the same order on every rank (as NCCL's single stream does for DDP).
Each state also has a netdist subgroup of its own, so its collectives never interleave
with other traffic on ``job.group``; build the states in the same order on every rank.

Failure. A netdist error (a lost peer, a timeout) fails the bucket's future, so DDP's
backward raises it (as a ``RuntimeError`` carrying netdist's message), and every later
bucket of the same state fails with it too: after a failed collective the group is
broken (``netdist.collectives.Group``), so treat the job as failed.

Bytes. ``state.stats`` counts the gradient payload this rank handed to netdist and the
payload netdist handed back, per step and in total, next to what a plain float32
all-reduce of the same buckets would hand the collective (``4 x numel``); the ratio is
the saving. These are the bytes the compression changes; the collective's own traffic
factor comes on top (a ring all-reduce sends ``2 (n - 1) / n`` times its buffer) and is
the same for every hook. ``netdist_bytes_sent`` is netdist's own counter of everything
the algorithm sent, control messages included (equal to the payload for the top-k and
cast hooks).
"""

# No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares
# ``comm_hook``'s annotations with ``dist.GradBucket`` and ``Future[Tensor]`` themselves.

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from netdist.collectives import Group
from netdist.compression.topk import TopKCompressor
from netdist.errors import CollectiveError, ParameterServerError
from netdist.parallel.aggregators import Fp16AllReduceAggregator, TopKAggregator
from netdist.progress import Job
from netdist.progress.proxy import unwrap
from netdist.ps import ColocatedPS, ParameterServer, SGDConfig, ServerReport, VersionLogEntry
from netdist.collectives.tags import TagRange
from netdist.ps._link import reserve_ps_tags
from netdist.ps.protocol import SHARDED_OWNER
from netdist.tensors import as_array
from netdist.bfloat16 import bfloat16_to_float32, cast_into, float32_to_bfloat16, widen_bfloat16
from netdist.types import BFLOAT16

__all__ = [
    "comm_hook",
    "job_of",
    "CommHookState",
    "HookStats",
    "StepBytes",
    "TopKHook",
    "Fp16Hook",
    "Bf16Hook",
    "Bf16AllReduceAggregator",
    "ParameterServerHook",
    "BoundedStalenessHook",
]

_FP32_ITEMSIZE = 4


# -- statistics ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepBytes:
    """The gradient payload of one training step (all of its buckets) on this rank."""

    sent: int
    """Payload bytes this rank handed to netdist."""
    received: int
    """Payload bytes netdist delivered to this rank (other ranks' pairs, the average)."""
    fp32_bytes: int
    """What a plain float32 all-reduce would have handed the collective: ``4 x numel``."""
    buckets: int
    """DDP buckets in the step."""

    @property
    def ratio(self) -> float:
        """``sent / fp32_bytes`` (0.0 when nothing was communicated)."""
        return self.sent / self.fp32_bytes if self.fp32_bytes else 0.0


@dataclass(frozen=True, slots=True)
class HookStats:
    """Totals over every completed step, and the last step (a snapshot; see ``stats``)."""

    steps: int
    bytes_sent: int
    bytes_received: int
    fp32_bytes: int
    netdist_bytes_sent: int
    """netdist's own counter of what the algorithm sent, control messages included."""
    last_step: StepBytes

    @property
    def ratio(self) -> float:
        """``bytes_sent / fp32_bytes`` over the whole run (0.0 before any traffic)."""
        return self.bytes_sent / self.fp32_bytes if self.fp32_bytes else 0.0


_NO_STEP = StepBytes(0, 0, 0, 0)


class _Recorder:
    """Counts bytes on the progress thread; hands out snapshots to any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = 0
        self._sent = self._received = self._fp32 = self._netdist = 0
        self._current = [0, 0, 0, 0]
        self._last = _NO_STEP

    def add(self, sent: int, received: int, fp32: int, netdist_sent: int, *,
            buckets: int, ends_step: bool) -> None:
        with self._lock:
            self._sent += sent
            self._received += received
            self._fp32 += fp32
            self._netdist += netdist_sent
            cur = self._current
            cur[0] += sent
            cur[1] += received
            cur[2] += fp32
            cur[3] += buckets
            if ends_step:
                self._last = StepBytes(*cur)
                self._current = [0, 0, 0, 0]
                self._steps += 1

    def snapshot(self) -> HookStats:
        with self._lock:
            return HookStats(self._steps, self._sent, self._received, self._fp32,
                             self._netdist, self._last)


# -- the hook and its base state ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Bucket:
    """What the coroutine needs of a ``GradBucket``, read on DDP's thread."""

    index: int
    is_last: bool
    buffer: torch.Tensor
    gradients: tuple[torch.Tensor, ...]
    parameters: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, bucket: dist.GradBucket) -> "_Bucket":
        buffer = bucket.buffer()
        if buffer.device.type != "cpu":
            raise ValueError(f"netdist comm hooks work on CPU gradients; bucket "
                             f"{bucket.index()} is on {buffer.device}")
        if not buffer.is_floating_point():
            raise TypeError(f"bucket {bucket.index()} holds {buffer.dtype} gradients; "
                            "netdist comm hooks average floating-point gradients")
        return cls(int(bucket.index()), bool(bucket.is_last()), buffer,
                   tuple(bucket.gradients()), tuple(bucket.parameters()))

    @property
    def fp32_bytes(self) -> int:
        return int(self.buffer.numel()) * _FP32_ITEMSIZE


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU float tensor sharing its memory (``netdist.tensors``:
    bfloat16 as ``netdist.types.BFLOAT16``, with or without ``ml_dtypes``)."""
    return as_array(tensor, "netdist comm hook")


async def _new_subgroup(world: Group) -> Group:
    return world.new_group(list(range(world.world_size)))


class CommHookState:
    """Base of the hook states: ordering, completion of DDP's futures, statistics, close.

    Subclasses implement ``_reduce(bucket)``, a coroutine run on the progress thread that
    writes the bucket's average into ``bucket.buffer`` and returns the bytes it moved.
    Pass the state to ``register_comm_hook`` together with ``comm_hook``.
    """

    def __init__(self, job: Job, *, timeout: float | None = None) -> None:
        if not isinstance(job, Job):
            raise TypeError(f"a netdist comm hook needs a netdist.Job (netdist.connect()), "
                            f"got {type(job).__name__}")
        if job.closed:
            raise ValueError("the netdist Job is closed")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.job = job
        self.timeout = timeout
        """Bound on each collective of the hook (None: the job's timeout)."""
        self.rank = job.rank
        self.world_size = job.world_size
        self._group: Group = job.run(_new_subgroup(unwrap(job.group)))
        self._recorder = _Recorder()
        self._submit_lock = threading.Lock()
        self._next_ticket = 0  # hook thread, under _submit_lock
        self._turn = 0  # loop thread
        self._waiters: dict[int, asyncio.Future[None]] = {}  # loop thread
        self._failure: BaseException | None = None  # loop thread
        self._closed = False

    # -- public ----------------------------------------------------------------------------

    @property
    def stats(self) -> HookStats:
        """Bytes so far: totals and the last completed step (a consistent snapshot)."""
        return self._recorder.snapshot()

    @property
    def group(self) -> Group:
        """The netdist subgroup this state's collectives run on (use it on the loop only)."""
        return self._group

    def register(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """``model.register_comm_hook(self, comm_hook)``."""
        model.register_comm_hook(self, comm_hook)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``bucket`` on the progress thread; return its future at once."""
        if self._closed:
            raise CollectiveError(f"{type(self).__name__} was closed; register a new "
                                  "state to keep training")
        b = _Bucket.of(bucket)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._submit(lambda: self._run_bucket(b), [(future, b.buffer)],
                     f"{type(self).__name__} bucket {b.index}")
        return _for_ddp(future)

    def close(self) -> None:
        """Release the state's netdist resources. Call it on every rank, after the last
        backward and before ``job.close()``; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.job.closed:
            self.job.run(self._aclose())

    def __enter__(self) -> "CommHookState":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<{type(self).__name__} rank {self.rank} of {self.world_size}: {s.steps} "
                f"steps, {s.bytes_sent} bytes sent ({s.ratio:.3f} of fp32)>")

    # -- subclasses -------------------------------------------------------------------------

    async def _reduce(self, b: _Bucket) -> tuple[int, int, int]:
        """Average ``b.buffer`` in place; return ``(sent, received, netdist_sent)``."""
        raise NotImplementedError

    async def _aclose(self) -> None:
        await self._group.aclose()

    # -- plumbing ---------------------------------------------------------------------------

    async def _run_bucket(self, b: _Bucket) -> None:
        sent, received, netdist_sent = await self._reduce(b)
        fp32 = b.fp32_bytes if self.world_size > 1 else 0
        self._recorder.add(sent, received, fp32, netdist_sent, buckets=1,
                           ends_step=b.is_last)

    def _submit(self, body: Callable[[], Awaitable[None]],
                completions: Sequence[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]],
                op: str) -> None:
        """Run ``body`` on the progress thread after every body submitted before it; then
        complete each future with its tensor (or fail them all with the error)."""
        with self._submit_lock:
            ticket = self._next_ticket
            handle = self.job.submit(self._in_turn(ticket, body), op)
            self._next_ticket = ticket + 1

        def done(h: Any) -> None:
            try:
                h.result()
            except BaseException as exc:  # noqa: BLE001 - handed to DDP through the futures
                error = exc if isinstance(exc, Exception) else CollectiveError(
                    f"{op} was cancelled (the netdist job is closing): {exc!r}")
                for future, _ in completions:
                    # torch annotates the argument as the future's value type
                    future.set_exception(error)  # type: ignore[arg-type]
                return
            for future, tensor in completions:
                future.set_result(tensor)

        handle.add_done_callback(done)

    async def _in_turn(self, ticket: int, body: Callable[[], Awaitable[None]]) -> None:
        """Wait for the bodies of earlier tickets, run this one, let the next one go."""
        loop = asyncio.get_running_loop()
        if self._turn != ticket:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters[ticket] = waiter
            await waiter
        try:
            if self._failure is not None:
                raise CollectiveError(
                    f"{type(self).__name__}: not sent, because an earlier bucket's "
                    f"communication failed (the group is broken): {self._failure}")
            await body()
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            raise
        finally:
            self._turn = ticket + 1
            successor = self._waiters.pop(self._turn, None)
            if successor is not None and not successor.done():
                successor.set_result(None)


def _value(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return future.value()


def _for_ddp(future: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """``future`` as DDP's C++ reducer can read it.

    ``Future.set_exception`` stores the exception as the future's *value*, which only
    Python's ``wait()`` turns back into an error; the reducer would try to read it as a
    tensor. A ``then`` callback that raises marks its future failed in C++, so DDP's
    backward raises a ``RuntimeError`` carrying netdist's message.
    """
    return future.then(_value)


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook of every netdist state: ``state(bucket)``.

    ``model.register_comm_hook(state, comm_hook)``; the state decides the algorithm.
    """
    return state(bucket)


def job_of(process_group: dist.ProcessGroup | None = None) -> Job:
    """The netdist ``Job`` behind a process group that runs the CPU on netdist
    (``"netdist"``, or ``"cpu:netdist,..."`` beside another device's backend; default:
    the world group), so the hooks share the backend's connections and progress thread
    instead of joining a second job. A group on another backend (Gloo) raises
    ``TypeError``: connect a job of its own with ``netdist.connect()`` then. The hooks
    average over the job's whole world, so a subgroup raises ``ValueError``.
    """
    from netdist.torch.backend import NetdistOps

    pg = dist.group.WORLD if process_group is None else process_group
    if pg is None:
        raise ValueError("torch.distributed is not initialised: call init_process_group first")
    backend: Any = pg
    if not isinstance(backend, NetdistOps):
        try:  # a c10d ProcessGroup with netdist as its CPU backend
            backend = pg._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError):
            backend = None
    if not isinstance(backend, NetdistOps):
        name = pg.name() if hasattr(pg, "name") else type(pg).__name__
        raise TypeError(f"the process group runs on {name!r}, not on netdist; connect a "
                        "netdist Job for the hooks with netdist.connect()")
    job = backend.job
    if pg.size() != job.world_size:
        raise ValueError(f"the process group has {pg.size()} of the job's {job.world_size} "
                         "ranks; netdist comm hooks average over the whole job")
    return job


# -- top-k ------------------------------------------------------------------------------------

class TopKHook(CommHookState):
    """Top-k sparsification with error feedback (``netdist.parallel.TopKAggregator``).

    Every parameter's gradient in a bucket keeps its ``max(1, ceil(ratio * numel))``
    largest-magnitude entries (ties: lowest index); this rank sends them as ``int32``
    indices plus values in one all-gather per bucket, and every rank adds all ranks'
    entries into zeros in rank order and divides by the world size, so all ranks apply
    bitwise the same gradient. At ``ratio=1.0`` that is exactly DDP's average.

    Error feedback: what a parameter does not send stays in its residual (a float tensor
    of the parameter's size, ``residual(param)``) and is added to its next gradient, so
    no gradient mass is lost, only delayed. Residuals belong to parameters, not to
    buckets, so they survive DDP rebuilding its buckets after the first iteration.
    ``momentum > 0`` turns on Deep Gradient Compression's momentum correction.

    Bytes per step: ``sum over parameters of k * (4 + itemsize)`` sent, ``(world_size -
    1)`` times that received; about ``2 * ratio`` of float32's bytes.
    """

    def __init__(self, job: Job, ratio: float = 0.01, *, error_feedback: bool = True,
                 momentum: float = 0.0, timeout: float | None = None) -> None:
        TopKCompressor(ratio, error_feedback=error_feedback, momentum=momentum)  # validates
        super().__init__(job, timeout=timeout)
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.momentum = float(momentum)
        self._aggregators: dict[int, tuple[tuple[int, ...], TopKAggregator]] = {}
        self._residuals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._velocities: dict[int, torch.Tensor] = {}

    def residual(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of what error feedback still holds back for ``param``, shaped like it
        (zeros before its first step). Read it between steps."""
        entry = self._residuals.get(id(param))
        if entry is None or entry[0] is not param:
            return torch.zeros_like(param)
        return entry[1].detach().clone().reshape(param.shape)

    def _state_of(self, param: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
        entry = self._residuals.get(id(param))
        if entry is None or entry[0] is not param:
            residual = torch.zeros(param.numel(), dtype=param.dtype)
            self._residuals[id(param)] = (param, residual)
            if self.momentum:
                self._velocities[id(param)] = torch.zeros(param.numel(), dtype=param.dtype)
            entry = self._residuals[id(param)]
        velocity = self._velocities.get(id(param))
        return _as_numpy(entry[1]), None if velocity is None else _as_numpy(velocity)

    def _aggregator(self, b: _Bucket) -> TopKAggregator:
        """The bucket's aggregator, its compressor's residuals being the parameters' own."""
        key = tuple(id(p) for p in b.parameters)
        known = self._aggregators.get(b.index)
        if known is not None and known[0] == key:
            return known[1]
        agg = TopKAggregator(self._group, self.ratio, self.error_feedback,
                             momentum=self.momentum, timeout=self.timeout)
        if self.error_feedback:
            states = [self._state_of(p) for p in b.parameters]
            agg.compressor.residuals = [r for r, _ in states]
            if self.momentum:
                agg.compressor.velocities = [v for _, v in states if v is not None]
        self._aggregators[b.index] = (key, agg)
        return agg

    async def _reduce(self, b: _Bucket) -> tuple[int, int, int]:
        agg = self._aggregator(b)
        arrays = [_as_numpy(g) for g in b.gradients]
        results = await agg.aggregate(arrays)
        for result, array in zip(results, arrays):
            if result is not array:
                np.copyto(array, result)
        sent = agg.last_bytes_sent
        return sent, sent * (self.world_size - 1), sent


# -- fp16 / bf16 ------------------------------------------------------------------------------

class Bf16AllReduceAggregator(Fp16AllReduceAggregator):
    """``Fp16AllReduceAggregator`` with bfloat16 on the wire.

    Each gradient is scaled by ``1 / world_size`` in its own precision (bfloat16 in
    float32, as torch computes it) and rounded to bfloat16 (nearest even, through float32
    as torch's ``.to(torch.bfloat16)`` does), the buckets are summed in bfloat16 by
    netdist's all-reduce and cast back. bfloat16 has float32's range, so nothing
    saturates. Needs no extra package: the wire dtype is ``netdist.types.BFLOAT16``
    (``ml_dtypes.bfloat16`` where installed, else the raw bits), and the bits are the
    same either way.
    """

    def _wire_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        return BFLOAT16

    def _fill(self, target: np.ndarray, grad: np.ndarray) -> None:
        scale = 1.0 / self.group.world_size
        if grad.dtype.kind == "V":  # bfloat16: one float32 multiply, rounded below
            scaled = bfloat16_to_float32(grad)
            scaled *= scale
        else:
            scaled = np.multiply(grad, scale)  # in the gradient's own precision
        float32_to_bfloat16(scaled, out=target)  # float64 rounds to float32 first, as torch


class _CastHook(CommHookState):
    """One cast aggregator per DDP bucket index (each keeps its wire buffer), the bucket
    being its single gradient; see ``Fp16Hook`` and ``Bf16Hook``."""

    _aggregator_class: type[Fp16AllReduceAggregator] = Fp16AllReduceAggregator

    def __init__(self, job: Job, *, timeout: float | None = None) -> None:
        super().__init__(job, timeout=timeout)
        self._aggregators: dict[int, Fp16AllReduceAggregator] = {}
        self._aggregator_class(self._group, timeout=timeout)  # fail early on bad options

    async def _reduce(self, b: _Bucket) -> tuple[int, int, int]:
        agg = self._aggregators.get(b.index)
        if agg is None:
            agg = self._aggregators[b.index] = self._aggregator_class(
                self._group, max_in_flight=1, timeout=self.timeout)
        flat = _as_numpy(b.buffer)
        result = (await agg.aggregate([flat]))[0]
        if result is not flat:
            np.copyto(flat, result)
        sent = agg.last_bytes_sent
        return sent, sent, sent


class Fp16Hook(_CastHook):
    """float16 compression (``netdist.parallel.Fp16AllReduceAggregator``).

    Per bucket: ``fp16(g * (1 / world_size))`` saturating at +-65504, summed in float16
    by netdist's all-reduce, cast back into the bucket. Sends ``2 x numel`` bytes: half of
    float32. Like torch's ``fp16_compress_hook``, except that ``g / world_size`` is rounded
    to float16 once, where torch's hook rounds ``g`` and then divides in float16 (a
    second rounding for results in float16's subnormal range).
    """


class Bf16Hook(_CastHook):
    """bfloat16 compression (``Bf16AllReduceAggregator``): as ``Fp16Hook`` with bfloat16
    on the wire -- float32's range and 8 significant bits. No extra package needed."""

    _aggregator_class = Bf16AllReduceAggregator


# -- parameter server ---------------------------------------------------------------------------

async def _new_parameter_server(group: Group, root: int, timeout: float | None,
                                tags: TagRange | None) -> ParameterServer:
    return ParameterServer(group, root=root, timeout=timeout, tags=tags)


class ParameterServerHook(CommHookState):
    """Synchronous averaging through netdist's rank-0 parameter server
    (``netdist.ps.ParameterServer``).

    Each bucket is one round: every rank sends its bucket to the server rank (``root``,
    which trains too), the server sums them in rank order (its own first), divides by
    the world size and sends the average to every rank, so every rank applies the very
    bytes the server computed. At two ranks that is DDP's own average bit for bit.

    Bytes per bucket of ``B`` bytes: a worker sends and receives ``B``; the server
    receives and sends ``(world_size - 1) x B`` (a star, not a ring: the server's link
    carries everything). ``netdist_bytes_sent`` adds the layout each rank announces once
    per new bucket layout. ``tags``: the server's transport tags; by default the next
    range reserved from the job's group, so each hook on one job has its own.
    """

    def __init__(self, job: Job, *, root: int = 0, timeout: float | None = None,
                 tags: TagRange | None = None) -> None:
        super().__init__(job, timeout=timeout)
        self.root = root
        self._ps: ParameterServer = job.run(
            _new_parameter_server(self._group, root, timeout, tags))

    @property
    def is_server(self) -> bool:
        return self.rank == self.root

    async def _reduce(self, b: _Bucket) -> tuple[int, int, int]:
        flat = _as_numpy(b.buffer)
        before = self._ps.bytes_sent
        averaged = (await self._ps.reduce_gradients([flat]))[0]
        np.copyto(flat, averaged)
        peers = self.world_size - 1
        payload = flat.nbytes * (peers if self.is_server else 1) if peers else 0
        return payload, payload, self._ps.bytes_sent - before

    async def _aclose(self) -> None:
        try:
            await self._ps.aclose()
        finally:
            await super()._aclose()


class BoundedStalenessHook(CommHookState):
    """Averaging through parameter servers with bounded staleness (``netdist.ps.ColocatedPS``).

    Every rank trains and ranks ``0 .. num_servers - 1`` also serve a shard (default: every
    rank, so the traffic is spread like DDP's). The servers hold an accumulator ``A`` of
    every parameter (float64 by default, zeros at the start) and run SGD with learning
    rate 1 on it, so an update applies ``A -= (sum of the pushed gradients) /
    world_size``. Once per training step (on DDP's last bucket, with all buckets'
    gradients) a rank pushes its gradients, pulls ``A`` and hands DDP ``A_before - A_now``:
    the sum of every update the servers applied since this rank's previous pull, its own
    included. Summed over a run, every rank therefore applies every rank's gradient,
    averaged, exactly once (up to the rounding of ``A``), and a plain SGD optimizer keeps
    every rank's model equal to ``initial - lr * (A_0 - A)`` at the version it pulled.

    ``max_staleness=k`` is the servers' stale-synchronous rule
    (``netdist.ps.StalenessController``): an update applies only if no rank's last pull
    then lags more than ``k`` versions behind, so a fast rank runs at most ``k`` steps
    ahead and every applied gradient was computed at most ``k`` versions ago; ``0`` is
    synchronous, ``None`` fully asynchronous. ``staleness_log()`` and ``report`` (after
    ``close()``) give the servers' record of every applied push.

    Why the accumulator is float64: a rank receives differences of ``A``, which lose
    ``eps(A)`` each; in float64 that stays far below float32's precision for any
    realistic run. ``dtype=torch.float32`` halves the bytes at that cost.

    Bytes per step: ``numel x itemsize`` pushed and the same pulled, shared among the
    servers (the share of this rank's own server goes through memory, not the network).
    ``close()`` must be called on every rank: a server rank serves until all ranks are
    done. The hook needs every parameter in every step (no unused parameters).
    """

    def __init__(self, job: Job, *, max_staleness: int | None = 1,
                 num_servers: int | None = None, dtype: torch.dtype = torch.float64,
                 timeout: float | None = None, tags: TagRange | None = None) -> None:
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        servers = job.world_size if num_servers is None else num_servers
        if not 1 <= servers <= job.world_size:
            raise ValueError(f"num_servers must be in 1..{job.world_size}, got {num_servers}")
        super().__init__(job, timeout=timeout)
        self.max_staleness = max_staleness
        self.num_servers = servers
        self.tags = reserve_ps_tags(self._group, SHARDED_OWNER, tags)
        """The transport tags of this hook's servers and workers (reserved at construction,
        so hooks built in the same order on every rank agree)."""
        self._np_dtype = np.dtype(np.float64 if dtype is torch.float64 else np.float32)
        self._names: dict[int, tuple[torch.Tensor, str]] = {}  # hook thread
        self._pending: list[tuple[_Bucket, torch.futures.Future[torch.Tensor]]] = []
        self._ps: ColocatedPS | None = None  # loop thread from here on
        self._accumulator: dict[str, np.ndarray] = {}
        self.report: ServerReport | None = None
        """This rank's server report once ``close()`` returned (None on non-server ranks)."""

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Hold the bucket until DDP's last one, then run the step's push and pull."""
        if self._closed:
            raise CollectiveError("BoundedStalenessHook was closed; register a new state "
                                  "to keep training")
        b = _Bucket.of(bucket)
        if b.index == 0:
            self._pending = []  # buckets of a backward that never finished are dropped
        for p in b.parameters:
            known = self._names.get(id(p))
            if known is None or known[0] is not p:
                if self._ps_started():
                    raise ParameterServerError(
                        "BoundedStalenessHook: a parameter took part for the first time "
                        "after the servers were initialised; every parameter must have a "
                        "gradient in every step")
                self._names[id(p)] = (p, f"p{len(self._names)}")
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((b, future))
        if b.is_last:
            batch, self._pending = self._pending, []
            self._submit(lambda: self._step(batch), [(f, pb.buffer) for pb, f in batch],
                         "BoundedStalenessHook step")
        return _for_ddp(future)

    def _ps_started(self) -> bool:
        return self._ps is not None

    def staleness_log(self) -> list[VersionLogEntry]:
        """This rank's server log so far: one entry per applied push (worker index, the
        version its gradient was computed on, the version it was applied to). Empty on
        ranks that do not serve. Call it between steps."""
        async def read() -> list[VersionLogEntry]:
            ps = self._ps
            return [] if ps is None or ps.server is None else ps.server.log

        return self.job.run(read())

    async def _step(self, batch: Sequence[tuple[_Bucket, Any]]) -> None:
        grads: dict[str, np.ndarray] = {}
        targets: dict[str, np.ndarray] = {}
        fp32 = 0
        for b, _ in batch:
            fp32 += b.fp32_bytes
            for p, g in zip(b.parameters, b.gradients):
                name = self._names[id(p)][1]
                view = _as_numpy(g)
                grads[name] = widen_bfloat16(view).astype(self._np_dtype)  # the server's dtype
                targets[name] = view
        ps = self._ps
        if ps is None:
            ps = ColocatedPS(self._group, num_servers=self.num_servers, timeout=self.timeout,
                             tags=self.tags)
            zeros = {name: np.zeros(g.shape, self._np_dtype) for name, g in grads.items()}
            try:
                initial = await ps.init(zeros, optimizer=SGDConfig(lr=1.0),
                                        max_staleness=self.max_staleness)
            except BaseException as exc:
                await ps.abort(f"init failed on rank {self.rank}: {exc}")
                raise
            self._ps = ps
            self._accumulator = dict(zip(zeros, initial))
        before = ps.bytes_sent
        pulled = await ps.step(grads)
        for name, now in zip(ps.client.names, pulled):
            delta = self._accumulator[name] - now
            cast_into(targets[name], delta)
            self._accumulator[name] = now
        payload = sum(g.nbytes for g in grads.values())
        self._recorder.add(payload, payload, fp32 if self.world_size > 1 else 0,
                           ps.bytes_sent - before, buckets=len(batch), ends_step=True)

    async def _aclose(self) -> None:
        try:
            if self._ps is not None:
                self.report = await self._ps.close()
        finally:
            await super()._aclose()
