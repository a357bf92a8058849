"""Worker side of the dedicated parameter servers: ``PSClient``.

::

    async with PSClient(group, num_servers=2) as client:        # ranks 0, 1 serve
        params = await client.init(model_arrays, optimizer=SGDConfig(lr=0.1, momentum=0.9),
                                   max_staleness=0)            # worker 0's values win
        for batch in data:
            grads = compute_gradients(params, batch)
            params = await client.step(grads)                  # push + pull, one round trip
    # leaving the block tells the servers this worker is done (or that it failed)

``step`` is the aggregator-style entry point for server-side optimizers: it returns the
*new parameters*, not averaged gradients, so a training loop copies them into its model
(``client.step(grads, out=[p.data for p in model.parameters()])`` does that in place)
instead of running a local optimizer.

Torch tensors: parameters, gradients and ``out=`` targets may be CPU torch tensors
(or a name -> tensor mapping such as ``dict(model.named_parameters())``). They are read
and written through NumPy views of their memory (``netdist.tensors``); a non-contiguous
``out=`` tensor is filled through a contiguous copy that is copied back. Results come
back as tensors when tensors went in: ``init`` of tensors makes ``pull``/``step`` without
``out=`` return new tensors, and ``out=`` tensors are returned as they are.

Every request goes to all servers concurrently. To each server it is a control header
and then that server's share in segments (``plan_segments``): a large slice travels as
its own message, straight from and into the tensor's memory, and runs of small slices
are packed into one. Only the initial values at init go as one flat buffer
(``ShardPlan.pack``). docs/PROTOCOL.md section 9 gives the messages.

Failover (``replicas=1``, every server and worker of the job alike): each request carries
a sequence number, the same to every shard. When the server of a shard is lost
(``PeerLostError``: a killed process is seen at once, a stopped one after the transport's
liveness window) and had not told this worker why, the shard's backup server takes it
over: this worker sends the request that was in flight to the backup, once, with the
same sequence number, so a push the backup already applied is not applied again. Every
update acknowledged to any worker (by the answer to a pull or step) is on the backup, so
none is lost; the worker is held for the time the transport takes to notice the loss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from netdist.errors import NetdistError, ParameterServerError, PeerLostError
from netdist.ps.faults import ReplicaLayout, WorkerLoss
from netdist.optim import AdamConfig, OptimizerConfig, SGDConfig
from netdist.collectives.tags import TagRange
from netdist.ps._link import (
    GroupLike,
    Loopback,
    WorkerSession,
    open_endpoint,
    reserve_ps_tags,
    run_all,
)
from netdist.ps.protocol import (
    NO_STALENESS_BOUND,
    PULL,
    PUSH,
    SHARDED_OWNER,
    Kind,
    ShardedStream,
    decode_header,
    encode_header,
    shard_tag_range,
    stream_tag,
)
from netdist.ps.messages import Segment, plan_segments
from netdist.ps.placement import DEFAULT_BIGARRAY_BOUND, ShardPlan, plan_shards, specs_from_arrays
from netdist.tensors import StagedOut, as_array, is_tensor, stage_out, to_tensor
from netdist.transport.base import Transport
from netdist.types import dtype_from_wire

__all__ = ["PSClient"]

_ERRMSG_TIMEOUT = 5.0

Tensors = Sequence[np.ndarray] | Mapping[str, np.ndarray]


class _ServerLost(Exception):
    """Internal: the server of a shard was lost mid-request.

    ``error`` is what the worker raises if it cannot fail over; ``told`` is True when the
    server said why it went (its ERROR), which no backup can fix.
    """

    def __init__(self, error: ParameterServerError, told: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.told = told


class PSClient(WorkerSession):
    """One worker's connection to the ``num_servers`` dedicated servers of its job.

    ``group`` is a ``netdist.collectives.Group`` or a ``Transport``; ranks
    ``0 .. num_servers-1`` of it run ``PSServer`` and this rank must be a worker rank.
    ``timeout`` bounds every wait, including a pull held back by the staleness rule.
    ``tags``: the job's transport tags; by default the next range reserved from the group
    (``Group.reserve_tags``), the one each server reserves too when every rank builds its
    parameter servers in the same order.
    With ``colocated=True`` every rank is a worker and the server ranks also serve; the
    rank's server and client then share ``loopback`` (``ColocatedPS`` sets this up).
    ``replicas=1``: the servers keep a backup of every shard, and this worker fails over
    to it when a server is lost (see the module doc).
    """

    def __init__(self, group: GroupLike | Transport, *, num_servers: int,
                 timeout: float | None = None, tags: TagRange | None = None,
                 colocated: bool = False, loopback: Loopback | None = None,
                 replicas: int = 0) -> None:
        self._ep, self.roles = open_endpoint(group, num_servers=num_servers, timeout=timeout,
                                             colocated=colocated, loopback=loopback)
        if not self.roles.is_worker(self._ep.rank):
            raise ParameterServerError(
                f"rank {self._ep.rank} is a server rank (servers are ranks "
                f"0..{num_servers - 1}); run PSServer there")
        self.worker_index = self.roles.worker_index(self._ep.rank)
        self.tags = reserve_ps_tags(group, SHARDED_OWNER, tags)
        """The transport tags of this job's servers and workers (reserved from the group)."""
        if replicas and colocated:
            raise ValueError("replicas need dedicated server ranks (colocated=False)")
        self.layout = ReplicaLayout(num_servers, replicas)
        self._shard_tags = [shard_tag_range(self.tags, s) if self.layout.replicated
                            else self.tags for s in range(num_servers)]
        self._owner = list(range(num_servers))
        self.failovers: list[tuple[int, int]] = []
        """``(shard, new server rank)`` for every failover this worker made, in order."""
        self.plan: ShardPlan | None = None
        self.names: list[str] = []
        self.max_staleness: int | None = None
        self._versions = [0] * num_servers
        self._push_bufs: list[np.ndarray] = []
        self._pull_bufs: list[np.ndarray] = []
        self._segments: list[tuple[Segment, ...]] = []
        self._dtype = np.dtype(np.float64)
        self._pushed_since_pull = False
        self._tensors = False
        """init() got torch tensors: results without out= come back as tensors."""
        self._sequence = 0
        self._state = "new"  # new -> ready -> closed
        self.aborted = False
        """True once this worker told the servers it failed (``abort``)."""
        self.bytes_sent = 0
        """Payload bytes this worker has put on the wire (headers and gradients)."""
        self._recorder = self._ep.transport.recorder
        self._nbytes = 0
        """Bytes of the whole model, each way of a push or pull (trace spans)."""

    # -- properties ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._ep.rank

    @property
    def num_servers(self) -> int:
        return self.roles.num_servers

    @property
    def versions(self) -> tuple[int, ...]:
        """Per server, the version of the parameters this worker last pulled."""
        return tuple(self._versions)

    @property
    def timeout(self) -> float:
        return self._ep.timeout

    @property
    def owners(self) -> tuple[int, ...]:
        """Per shard, the server rank serving it now (its backup after a failover)."""
        return tuple(self._owner)

    # -- public API ----------------------------------------------------------------------

    async def init(self, params: Tensors, *, optimizer: OptimizerConfig,
                   max_staleness: int | None = 0,
                   bigarray_bound: int = DEFAULT_BIGARRAY_BOUND,
                   worker_loss: WorkerLoss = WorkerLoss.FAIL) -> list[np.ndarray]:
        """Register the model with the servers and return the initial parameters.

        Every worker passes tensors of the same names, shapes and dtype and the same
        options; the first worker's *values* become the initial parameters, which every
        worker gets back (fresh arrays, in ``params`` order). ``optimizer`` runs on the
        servers. ``max_staleness``: 0 = synchronous, ``k`` = bounded staleness, ``None`` =
        fully asynchronous (see ``StalenessController``). ``worker_loss``: what the
        servers do when a worker is lost (``WorkerLoss``; the default ends the job).
        """
        if self._state != "new":
            raise ParameterServerError(f"init() on a PSClient that is {self._state}")
        if not isinstance(optimizer, (SGDConfig, AdamConfig)):
            raise TypeError("optimizer must be an SGDConfig or AdamConfig, got "
                            f"{type(optimizer).__name__}")
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        if not isinstance(worker_loss, WorkerLoss):
            raise TypeError(f"worker_loss must be a WorkerLoss, got {worker_loss!r}")
        values = params.values() if isinstance(params, Mapping) else params
        tensors = not isinstance(params, np.ndarray) and any(is_tensor(v) for v in values)
        if tensors:
            params = self._arrays_of(params)
        specs = specs_from_arrays(params)
        plan = plan_shards(specs, self.num_servers, bigarray_bound=bigarray_bound)
        arrays = self._as_list(params, [s.name for s in specs])
        meta = msgpack.packb({
            "specs": [s.to_wire() for s in specs],
            "num_servers": self.num_servers,
            "bigarray_bound": int(bigarray_bound),
            "optimizer": optimizer.to_dict(),
            "max_staleness": NO_STALENESS_BOUND if max_staleness is None else max_staleness,
            **({} if worker_loss is WorkerLoss.FAIL else {"worker_loss": worker_loss.value}),
        })
        first = self.worker_index == 0
        self._state = "initialising"

        async def one(server: int) -> int:
            try:
                await self._send(server, ShardedStream.CTRL,
                                 encode_header(Kind.INIT, int(first)), "init")
                await self._send(server, ShardedStream.DATA, np.frombuffer(meta, np.uint8),
                                 "init")
                if first:
                    await self._send(server, ShardedStream.DATA, plan.pack(server, arrays),
                                     "init")
                version, _ = await self._reply(server, [], "init")
            except _ServerLost as lost:
                raise lost.error from lost.__cause__
            return version

        versions = await self._all([one(s) for s in range(self.num_servers)])
        dtype = dtype_from_wire(plan.dtype)
        self.plan = plan
        self.names = [s.name for s in specs]
        self.max_staleness = max_staleness
        self._versions = list(versions)
        self._segments = [plan_segments(plan, s) for s in range(self.num_servers)]
        self._dtype = dtype
        self._push_bufs = [np.empty(n, dtype) for n in plan.server_sizes]
        self._pull_bufs = [np.empty(n, dtype) for n in plan.server_sizes]
        self._nbytes = sum(plan.server_sizes) * dtype.itemsize
        self._tensors = tensors
        self._state = "ready"
        return await self.pull()

    async def push(self, grads: Tensors) -> None:
        """Send gradients (computed on the last pulled parameters) to every server.

        Returns once they are sent, not applied. With ``max_staleness`` set, a ``pull``
        must follow every ``push``.
        """
        plan = self._ready("push")
        arrays = self._as_list(grads, self.names)
        plan.check_arrays(arrays, writable=False)
        self._check_push()
        seq = self._next_sequence()
        with self._recorder.span("ps", "push", step=seq, bytes=self._nbytes,
                                 servers=self.num_servers):
            await self._all([self._request(s, PUSH, arrays, None, "push", seq)
                             for s in range(self.num_servers)])
        self._pushed_since_pull = True

    async def pull(self, *, out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Fetch the parameters from every server (after this worker's push has applied).

        Returns fresh arrays, or writes into ``out`` (C-contiguous, writable, same shapes)
        and returns it.
        """
        plan = self._ready("pull")
        targets, staged = self._outputs(plan, out)
        seq = self._next_sequence()
        with self._recorder.span("ps", "pull", step=seq, bytes=self._nbytes,
                                 servers=self.num_servers):
            await self._all([self._request(s, PULL, None, targets, "pull", seq)
                             for s in range(self.num_servers)])
        self._pushed_since_pull = False
        return self._results(targets, out, staged)

    async def step(self, grads: Tensors, *,
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Push ``grads`` and pull the updated parameters in one round trip per server.

        The aggregator entry point for server-side optimizers: returns the new
        parameters (see ``pull`` for ``out``).
        """
        plan = self._ready("step")
        arrays = self._as_list(grads, self.names)
        plan.check_arrays(arrays, writable=False)
        targets, staged = self._outputs(plan, out)
        self._check_push()
        seq = self._next_sequence()
        with self._recorder.span("ps", "step", step=seq, bytes=self._nbytes,
                                 servers=self.num_servers):
            await self._all([self._request(s, PUSH | PULL, arrays, targets, "step", seq)
                             for s in range(self.num_servers)])
        self._pushed_since_pull = False
        return self._results(targets, out, staged)

    async def close(self) -> None:
        """Tell every server this worker is done. Idempotent."""
        if self._state == "closed":
            return
        if self._state != "ready":
            await self.abort(f"worker rank {self.rank} closed before init completed")
            return
        self._state = "closed"

        async def one(shard: int) -> None:
            try:
                await self._send(shard, ShardedStream.CTRL, encode_header(Kind.DONE), "close")
            except _ServerLost as lost:
                if not self._fail_over(shard, lost):
                    raise lost.error from lost.__cause__
                try:
                    await self._send(shard, ShardedStream.CTRL, encode_header(Kind.DONE),
                                     "close")
                except _ServerLost as again:
                    raise again.error from again.__cause__

        await run_all([one(s) for s in range(self.num_servers)])

    async def abort(self, reason: str) -> None:
        """Tell every server this worker failed (best effort); they stop the whole job."""
        if self._state == "closed":
            return
        self._state = "closed"
        self.aborted = True
        text = np.frombuffer(reason.encode(), dtype=np.uint8)
        timeout = min(_ERRMSG_TIMEOUT, self._ep.timeout)

        async def one(shard: int) -> None:
            try:
                await self._ep.send(self._owner[shard], encode_header(Kind.ABORT),
                                    self._tag(ShardedStream.CTRL, shard=shard),
                                    timeout=timeout)
                await self._ep.send(self._owner[shard], text,
                                    self._tag(ShardedStream.ERRMSG, shard=shard),
                                    timeout=timeout)
            except NetdistError:
                pass

        await asyncio.gather(*(one(s) for s in range(self.num_servers)))

    # -- plumbing ------------------------------------------------------------------------

    async def _all(self, requests: list[Any]) -> list[Any]:
        """Run one request per server; if one fails, tell the other servers and raise.

        A lost or silent server, or a server's ERROR, ends this worker: it aborts on the remaining
        servers so they stop the job instead of waiting for it until their timeout.
        """
        try:
            return await run_all(requests)
        except NetdistError as exc:
            await self.abort(f"worker rank {self.rank} failed: {exc}")
            raise

    def _tag(self, stream: ShardedStream, index: int = 0, *, shard: int = 0) -> int:
        return stream_tag(self._shard_tags[shard], stream, index)

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def _fail_over(self, shard: int, lost: _ServerLost) -> bool:
        """Turn to ``shard``'s backup after its server was lost; False if there is none
        to turn to (no replicas, already failed over, or the server said why it went)."""
        backup = self.layout.backup(shard)
        if lost.told or backup is None or self._owner[shard] != shard:
            return False
        self._owner[shard] = backup
        self.failovers.append((shard, backup))
        return True

    def _ready(self, what: str) -> ShardPlan:
        if self._state != "ready" or self.plan is None:
            raise ParameterServerError(f"{what}() needs a PSClient after init() and before "
                                       f"close(); this one is {self._state}")
        return self.plan

    def _check_push(self) -> None:
        if self._pushed_since_pull and self.max_staleness is not None:
            raise ParameterServerError(
                f"push after push without pull: with max_staleness={self.max_staleness} "
                "every push must be followed by a pull (or use step())")

    @staticmethod
    def _arrays_of(tensors: Any) -> Any:
        """``tensors`` (a sequence or mapping) with every torch tensor replaced by a NumPy
        view of its memory."""
        if isinstance(tensors, Mapping):
            return {k: v if isinstance(v, np.ndarray) or not is_tensor(v)
                    else as_array(v, f"tensor {k!r}") for k, v in tensors.items()}
        if is_tensor(tensors):
            raise TypeError("expected a list of tensors, got a single torch.Tensor")
        return [v if isinstance(v, np.ndarray) or not is_tensor(v)
                else as_array(v, f"tensor {i}") for i, v in enumerate(tensors)]

    @classmethod
    def _as_list(cls, tensors: Tensors, names: Sequence[str]) -> list[np.ndarray]:
        if isinstance(tensors, Mapping):
            missing = [n for n in names if n not in tensors]
            extra = [k for k in tensors if k not in set(names)]
            if missing or extra:
                raise ValueError(f"tensors do not match the registered names: missing "
                                 f"{missing}, unexpected {extra}")
            return cls._arrays_of([tensors[n] for n in names])  # type: ignore[no-any-return]
        if isinstance(tensors, np.ndarray):
            raise TypeError("expected a list of arrays, got a single numpy.ndarray")
        return cls._arrays_of(tensors)  # type: ignore[no-any-return]

    @staticmethod
    def _outputs(plan: ShardPlan, out: Sequence[Any] | None
                 ) -> tuple[list[np.ndarray], list[StagedOut | None] | None]:
        """The arrays a pull lands in, and the staged ``out=`` tensors to finish."""
        if out is None:
            dtype = dtype_from_wire(plan.dtype)
            return [np.empty(s.shape, dtype) for s in plan.specs], None
        targets = list(out)
        staged: list[StagedOut | None] | None = None
        if any(is_tensor(t) for t in targets):
            staged = [stage_out(t, f"out[{i}]") if is_tensor(t) else None
                      for i, t in enumerate(targets)]
            targets = [t if s is None else s.array for t, s in zip(targets, staged)]
        plan.check_arrays(targets, writable=True)
        return targets, staged

    def _results(self, targets: list[np.ndarray], out: Sequence[Any] | None,
                 staged: list[StagedOut | None] | None) -> list[Any]:
        """What ``pull``/``step`` return: ``out`` as given (staged tensors copied back),
        or the fresh arrays, as tensors if ``init`` got tensors."""
        if out is None:
            return [to_tensor(t) for t in targets] if self._tensors else targets
        if staged is None:
            return targets
        return [t if s is None else s.finish() for t, s in zip(targets, staged)]

    async def _send(self, shard: int, stream: ShardedStream, data: Any, what: str, *,
                    index: int = 0) -> None:
        """Send to the server of ``shard`` (``_ServerLost`` if it is gone)."""
        self.bytes_sent += data.nbytes
        server = self._owner[shard]
        try:
            await self._ep.send(server, data, self._tag(stream, index, shard=shard))
        except PeerLostError as exc:
            raise await self._lost(shard, server, what, exc) from exc

    async def _lost(self, shard: int, server: int, what: str,
                    exc: PeerLostError) -> _ServerLost:
        """The error for a lost server: its own last word if it sent one, else the loss.

        A server that fails tells its workers why before it goes away; that ERROR may
        already sit in the mailbox while this worker was still sending.
        """
        try:
            raw = await self._ep.recv(server, self._tag(ShardedStream.REPLY, shard=shard),
                                      timeout=0.05)
            kind, _, _, _ = decode_header(raw, peer=server)
            if kind is Kind.ERROR:
                text = (await self._ep.recv(server,
                                            self._tag(ShardedStream.ERRMSG, shard=shard),
                                            timeout=0.05)).tobytes().decode(errors="replace")
                return _ServerLost(
                    ParameterServerError(f"{what} on worker rank {self.rank}: {text}"), True)
        except (NetdistError, ValueError):
            pass
        return _ServerLost(ParameterServerError(
            f"{what} on worker rank {self.rank}: lost parameter server rank {server}: "
            f"{self._ep.describe(exc)}"), False)

    async def _request(self, shard: int, flags: int, grads: list[np.ndarray] | None,
                       targets: list[np.ndarray] | None, what: str, seq: int) -> None:
        """One request to the server of ``shard``; after its loss, once to the backup."""
        try:
            await self._request_once(shard, flags, grads, targets, what, seq)
        except _ServerLost as lost:
            if not self._fail_over(shard, lost):
                raise lost.error from lost.__cause__
        else:
            return
        try:
            await self._request_once(shard, flags, grads, targets, what, seq)
        except _ServerLost as again:
            raise again.error from again.__cause__

    async def _request_once(self, shard: int, flags: int, grads: list[np.ndarray] | None,
                            targets: list[np.ndarray] | None, what: str, seq: int) -> None:
        """One request to the server of ``shard``: header, gradient segments, then the
        reply if pulling.

        Large slices go straight from the gradient tensors and land straight in
        ``targets``; small ones are packed into (and unpacked from) one buffer each way.
        """
        header = encode_header(Kind.REQUEST, flags, self._versions[shard], seq)
        await self._send(shard, ShardedStream.CTRL, header, what)
        segments = self._segments[shard]
        if flags & PUSH:
            if grads is None:  # pragma: no cover - internal misuse
                raise ParameterServerError("push without gradients")
            for seg in segments:
                await self._send(shard, ShardedStream.DATA, self._segment_data(seg, grads),
                                 what, index=seg.index)
        if flags & PULL:
            if targets is None:  # pragma: no cover - internal misuse
                raise ParameterServerError("pull without targets")
            landing = [self._segment_landing(shard, seg, targets) for seg in segments]
            version, _ = await self._reply(shard, landing, what)
            self._versions[shard] = version
            buffer = self._pull_bufs[shard]
            for seg in segments:
                if not seg.direct:
                    for piece in seg.slices:
                        targets[piece.key].reshape(-1)[piece.start:piece.stop] = \
                            buffer[piece.offset:piece.offset + piece.size]

    def _segment_data(self, seg: Segment, grads: list[np.ndarray]) -> np.ndarray:
        """The bytes of one gradient segment: a view of the tensor, or a packed copy."""
        if seg.direct:
            piece = seg.slices[0]
            tensor = grads[piece.key]
            if tensor.flags.c_contiguous and tensor.dtype == self._dtype:
                return tensor.reshape(-1)[piece.start:piece.stop]
        buffer = self._push_bufs[seg.slices[0].server]
        for piece in seg.slices:
            buffer[piece.offset:piece.offset + piece.size] = \
                np.ravel(grads[piece.key])[piece.start:piece.stop]
        return buffer[seg.offset:seg.offset + seg.size]

    def _segment_landing(self, server: int, seg: Segment,
                         targets: list[np.ndarray]) -> np.ndarray:
        if seg.direct:
            piece = seg.slices[0]
            return targets[piece.key].reshape(-1)[piece.start:piece.stop]
        return self._pull_bufs[server][seg.offset:seg.offset + seg.size]

    async def _reply(self, shard: int, landing: list[np.ndarray],
                     what: str) -> tuple[int, int]:
        """Wait for the answer of the server of ``shard``; parameter segment ``i`` lands in
        ``landing[i]``."""
        server = self._owner[shard]
        params_tasks = [asyncio.ensure_future(self._ep.recv(  # posted first: lands in place
            server, self._tag(ShardedStream.PARAMS, i, shard=shard), out=out))
            for i, out in enumerate(landing)]
        try:
            raw = await self._ep.recv(server, self._tag(ShardedStream.REPLY, shard=shard))
            try:
                kind, a, b, _ = decode_header(raw, peer=server)
            except ValueError as exc:
                raise ParameterServerError(f"{what}: {exc}") from None
            if kind is Kind.ERROR:
                try:
                    text = (await self._ep.recv(server,
                                                self._tag(ShardedStream.ERRMSG, shard=shard),
                                                timeout=min(_ERRMSG_TIMEOUT, self._ep.timeout))
                            ).tobytes().decode(errors="replace")
                except NetdistError as exc:
                    text = f"failed (its error text was lost: {exc})"
                raise ParameterServerError(f"{what} on worker rank {self.rank}: {text}")
            if kind is not Kind.OK:
                raise ParameterServerError(f"{what}: parameter server rank {server} sent "
                                           f"{kind.name} instead of OK")
            for task in params_tasks:
                await task
            return a, b
        except PeerLostError as exc:
            raise await self._lost(shard, server, what, exc) from exc
        finally:
            pending = [t for t in params_tasks if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*params_tasks, return_exceptions=True)
