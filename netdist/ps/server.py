"""Dedicated parameter-server processes: sharded parameters, server-side optimizer.

A job of ``world_size`` ranks runs ``S`` servers (ranks ``0 .. S-1``) and ``W`` workers
(ranks ``S .. world_size-1``); ``netdist ps-server`` runs the server side. Parameters are
placed by ``plan_shards`` -- large tensors sliced across all servers, small ones whole in
balanced key ranges -- so every server handles about ``1/S`` of the traffic and of the
optimizer work. Workers use ``netdist.ps.PSClient``.

Protocol, per worker and server (all messages on the server's tag range):

1. *init*: every worker sends ``INIT`` with its parameter specs (msgpack) and, from the
   first worker only, the initial values of this server's shard; worker 0 also chooses the
   optimizer and ``max_staleness``. Every worker must describe the same tensors and
   options, or every rank fails with a ``ParameterServerError`` naming the odd one out.
   The server answers ``OK`` with its version.
2. *requests*: ``REQUEST`` headers carrying ``PUSH`` (a gradient shard follows) and/or
   ``PULL`` (answer with this shard once the worker's push has applied), and the version
   the gradient was computed on. ``StalenessController`` decides when pushes apply: with
   ``max_staleness=0`` all workers' gradients of a version are averaged into one update
   (synchronous SGD); with ``k`` a push applies when no worker would fall more than ``k``
   versions behind; with ``None`` every push applies on arrival. An update sums the
   gradients in worker order, divides by ``W`` and runs the optimizer on the shard.
   bfloat16 parameters are kept as a float32 master copy with float32 optimizer state
   and sent back rounded to bfloat16 (``netdist.ps.shard.ServerShard``).
3. *shutdown*: a worker sends ``DONE``; the server returns from ``run()`` once every
   worker is done. A worker that fails sends ``ABORT`` with its error.

A lost, silent (past the timeout) or aborting worker makes the server send ``ERROR`` with
the reason to every other worker still running -- they raise ``ParameterServerError``
naming that worker -- and raise it itself. A lost server is seen by the workers' own
transport. Nothing waits longer than the timeout; note that the timeout also bounds how
long a worker may stay silent between requests (a long evaluation needs a long timeout).

Fault tolerance (``netdist.ps.faults``), both opt-in:

- ``worker_loss=WorkerLoss.CONTINUE`` (chosen by the workers at init): a lost, silent or
  aborting worker is *dropped* instead (``StalenessController.finish``): asynchronous and
  bounded-staleness training stop waiting for it, and synchronous training applies each
  later update once every remaining worker has pushed, dividing by the number of
  gradients in it. The server's report lists the dropped workers.
- ``replicas=1``: every shard has a backup server rank (``ReplicaLayout``), and each shard
  talks on a tag span of its own (``shard_tag_range``), whichever rank serves it. The
  primary forwards each update to the backup and applies it there before any pull that
  could see it is answered (``netdist.ps.replication``), so every acknowledged update is
  on two processes. When the primary is lost, the backup serves the shard from its copy
  (a second ``PSServer`` for that shard in the backup's process, whose clock is
  ``StalenessController.resume``d); workers retry the request that was in flight there
  once, and a retried push whose sequence number the shard already applied is received
  and discarded, not applied twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from netdist.errors import (
    NetdistError,
    NetdistTimeoutError,
    ParameterServerError,
    PeerLostError,
)
from netdist.optim import ShardOptimizer, optimizer_config_from_dict
from netdist.collectives.tags import TagRange
from netdist.ps._link import (
    GroupLike,
    Loopback,
    RankFailure,
    first_error,
    open_endpoint,
    reserve_ps_tags,
    run_all,
)
from netdist.ps.faults import ReplicaLayout, WorkerLoss
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
from netdist.ps.replication import BackupLink, ReplicaState, ShardBackup, UpdateRecord
from netdist.ps.messages import Segment, plan_segments
from netdist.ps.placement import ParamSpec, ShardPlan, plan_shards
from netdist.ps.shard import ServerShard
from netdist.ps.staleness import StalenessController, VersionLogEntry
from netdist.transport.base import Transport
from netdist.types import dtype_from_wire

__all__ = ["PSServer", "ServerReport", "serve"]

_NOTIFY_TIMEOUT = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerReport:
    """What a server did: its index, final version and the log of every applied push."""

    server: int
    version: int
    log: tuple[VersionLogEntry, ...]
    num_workers: int
    dropped: tuple[int, ...] = ()
    """Worker ranks dropped after a loss (``WorkerLoss.CONTINUE``), in order."""
    takeover: ServerReport | None = None
    """With replicas: the report of the shard this server took over from its lost
    primary (``server`` there is the shard's index), else None."""

    @property
    def max_staleness_observed(self) -> int:
        return max((e.staleness for e in self.log), default=0)


class PSServer:
    """One dedicated server rank; ``await run()`` serves until every worker is done.

    ``group`` is a ``netdist.collectives.Group`` or a ``Transport``; its first
    ``num_servers`` ranks are servers and this must be one of them. The workers are the
    other ranks or, with ``colocated=True``, every rank (this one included, reached
    through ``loopback``; ``ColocatedPS`` sets this up).
    ``replicas=1`` gives every shard a backup on the next server rank (see the module
    doc); every server and worker of the job must pass the same value.
    """

    def __init__(self, group: GroupLike | Transport, *, num_servers: int,
                 timeout: float | None = None, tags: TagRange | None = None,
                 colocated: bool = False, loopback: Loopback | None = None,
                 replicas: int = 0) -> None:
        self._ep, self.roles = open_endpoint(group, num_servers=num_servers, timeout=timeout,
                                             colocated=colocated, loopback=loopback)
        if not self.roles.is_server(self._ep.rank):
            raise ParameterServerError(
                f"rank {self._ep.rank} is a worker rank (servers are ranks "
                f"0..{num_servers - 1}); run PSClient there")
        if replicas and colocated:
            raise ValueError("replicas need dedicated server ranks (colocated=False)")
        self.layout = ReplicaLayout(num_servers, replicas)
        self.server = self._ep.rank
        self.tags = reserve_ps_tags(group, SHARDED_OWNER, tags)
        """The transport tags of this job's servers and workers (reserved from the group)."""
        self.shard_index = self.server
        """The shard this object serves: its own rank's, or one taken over."""
        self._shard_tags = (shard_tag_range(self.tags, self.server) if self.layout.replicated
                            else self.tags)
        backup = self.layout.backup(self.server)
        self._backup: BackupLink | None = (
            None if backup is None else
            BackupLink(self._ep, backup, self._shard_tags, self.server))
        self._resume: ReplicaState | None = None
        self._worker_loss = WorkerLoss.FAIL
        self._workers = list(self.roles.worker_ranks)
        self._applied_seq = [-1] * len(self._workers)
        """Per worker, the sequence number of its last applied push (for deduplication)."""
        self._push_seq = [-1] * len(self._workers)
        self._applying = False
        self._dropped: list[int] = []
        self.plan: ShardPlan | None = None
        self.shard: ServerShard | None = None
        """This server's shard (after init): master parameters, optimizer, pulled values."""
        self.clock: StalenessController | None = None
        self._grads: list[np.ndarray] = []
        self._segments: tuple[Segment, ...] = ()
        self._readers = 0
        self._changed = asyncio.Condition()
        self._apply_lock = asyncio.Lock()
        self._done = False
        self._started = False
        self._recorder = self._ep.transport.recorder

    # -- public --------------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        return self._ep.timeout

    @property
    def params(self) -> np.ndarray | None:
        """This server's flat parameter shard as workers pull it (wire dtype; after init)."""
        return None if self.shard is None else self.shard.wire

    @property
    def master(self) -> np.ndarray | None:
        """The parameters the optimizer updates: ``params`` itself, or for bfloat16 its
        float32 master copy (see ``netdist.ps.shard.ServerShard``)."""
        return None if self.shard is None else self.shard.master

    @property
    def optimizer(self) -> ShardOptimizer | None:
        return None if self.shard is None else self.shard.optimizer

    @property
    def version(self) -> int:
        return 0 if self.clock is None else self.clock.version

    @property
    def log(self) -> list[VersionLogEntry]:
        """One entry per applied push (worker index, its version, the server version)."""
        return [] if self.clock is None else list(self.clock.log)

    @property
    def dropped(self) -> list[int]:
        """Worker ranks dropped after a loss (``WorkerLoss.CONTINUE``)."""
        return list(self._dropped)

    async def run(self) -> ServerReport:
        """Initialise from the workers, serve their requests, return when all are done.

        Raises ``ParameterServerError`` (after telling every other worker) when a worker is
        lost, aborts or breaks the protocol, ``NetdistTimeoutError`` when one stays silent
        past the timeout -- unless the workers chose ``WorkerLoss.CONTINUE``, which drops
        that worker instead. With replicas this server also backs up the previous
        server's shard, and serves it too if that server is lost (``takeover`` in the
        report). Cancellation leaves the workers to their own timeouts.
        """
        if self._started:
            raise ParameterServerError("PSServer.run() can be called only once")
        self._started = True
        backed = self.layout.backed_up(self.server)
        if backed is None or self._resume is not None:
            return await self._run_shard()
        backup = ShardBackup(self._ep, backed, shard_tag_range(self.tags, backed), backed)
        try:
            async with asyncio.TaskGroup() as tg:
                own = tg.create_task(self._run_shard())
                other = tg.create_task(self._run_backup(backup))
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return dataclasses.replace(own.result(), takeover=other.result())

    async def _run_backup(self, backup: ShardBackup) -> ServerReport | None:
        """Mirror shard ``backup.shard``; serve it if its primary is lost."""
        state = await backup.run()
        if state is None:
            return None
        successor = PSServer.__new__(PSServer)
        successor.__dict__.update(self.__dict__)  # same endpoint, roles, tags and workers
        successor._take_over(backup.shard, state)
        return await successor._run_shard()

    def _take_over(self, shard: int, state: ReplicaState) -> None:
        """Become the server of ``shard`` from the backup's ``state`` (see ``run``)."""
        self.shard_index = shard
        self._shard_tags = shard_tag_range(self.tags, shard)
        self._backup = None  # the shard's one backup is this process: served unreplicated
        self._resume = state
        self._changed = asyncio.Condition()
        self._apply_lock = asyncio.Lock()
        self._readers = 0
        self._applying = False
        self._done = False
        self._dropped = []
        num_workers = len(self._workers)
        self._applied_seq = [state.applied.get(w, -1) for w in range(num_workers)]
        self._push_seq = [-1] * num_workers
        self._configure(state.meta, state.shard.wire, shard=state.shard)
        clock = self.clock
        if clock is None:  # pragma: no cover - _configure sets it
            raise ParameterServerError("takeover without a clock")
        self.clock = StalenessController.resume(num_workers, clock.max_staleness,
                                                state.version, state.log, sorted(state.done))

    async def _run_shard(self) -> ServerReport:
        """Serve this object's shard until every worker is done (``run``'s body)."""
        try:
            if self._resume is None:
                await self._initialise()
            await self._serve()
            if self._backup is not None:
                await self._backup.finish(self.version)
        except RankFailure as failure:
            worker = failure.rank
            message = (f"parameter server rank {self.server} lost worker rank {worker}: "
                       f"{failure.what}: {self._ep.describe(failure.error)}")
            await self._notify(message, skip=worker if isinstance(
                failure.error, PeerLostError) else None)
            if isinstance(failure.error, NetdistTimeoutError):
                raise NetdistTimeoutError(message) from failure.error
            raise ParameterServerError(message) from failure.error
        except ParameterServerError as exc:
            await self._notify(f"parameter server rank {self.server}: {exc}", skip=None)
            raise
        finally:
            self._done = True
            async with self._changed:
                self._changed.notify_all()
        clock = self.clock
        if clock is None:  # pragma: no cover - _initialise sets it
            raise ParameterServerError("server finished without initialising")
        return ServerReport(self.shard_index, clock.version, tuple(clock.log),
                            len(self._workers), tuple(self._dropped))

    async def wait_until(self, predicate: Callable[[PSServer], bool], *,
                         timeout: float | None = None) -> None:
        """Wait until ``predicate(self)`` holds (checked after every state change).

        For tests and monitoring, e.g. ``wait_until(lambda s: s.clock.blocked)``.
        """
        async with asyncio.timeout(self._ep.timeout if timeout is None else timeout):
            async with self._changed:
                await self._changed.wait_for(lambda: self._done or predicate(self))

    # -- init ----------------------------------------------------------------------------

    def _tag(self, stream: ShardedStream, index: int = 0) -> int:
        return stream_tag(self._shard_tags, stream, index)

    async def _recv(self, worker: int, stream: ShardedStream, what: str,
                    out: np.ndarray | None = None, index: int = 0) -> np.ndarray:
        try:
            return await self._ep.recv(worker, self._tag(stream, index), out=out)
        except NetdistError as exc:
            raise RankFailure(worker, what, exc) from exc

    async def _send(self, worker: int, stream: ShardedStream, data: Any, what: str, *,
                    index: int = 0) -> None:
        try:
            await self._ep.send(worker, data, self._tag(stream, index))
        except NetdistError as exc:
            raise RankFailure(worker, what, exc) from exc

    async def _recv_header(self, worker: int, what: str) -> tuple[Kind, int, int, int]:
        raw = await self._recv(worker, ShardedStream.CTRL, what)
        try:
            return decode_header(raw, peer=worker)
        except ValueError as exc:
            raise RankFailure(worker, what, ParameterServerError(str(exc))) from None

    async def _recv_init(self, worker: int) -> tuple[dict[str, Any], np.ndarray | None]:
        kind, has_values, _, _ = await self._recv_header(worker, "waiting for INIT")
        if kind is Kind.ABORT:
            await self._aborted(worker)
        if kind is not Kind.INIT:
            raise RankFailure(worker, "waiting for INIT",
                              ParameterServerError(f"sent {kind.name} before INIT"))
        raw = await self._recv(worker, ShardedStream.DATA, "receiving parameter specs")
        try:
            meta = msgpack.unpackb(raw.tobytes())
            if not isinstance(meta, dict):
                raise ValueError("not a map")
        except (ValueError, msgpack.UnpackException) as exc:
            raise RankFailure(worker, "receiving parameter specs",
                              ParameterServerError(f"unreadable specs: {exc}")) from None
        values = None
        if has_values:
            values = await self._recv(worker, ShardedStream.DATA, "receiving initial values")
        return meta, values

    async def _initialise(self) -> None:
        received = await run_all([self._recv_init(w) for w in self._workers])
        first_meta, values = received[0]
        first = self._workers[0]
        for worker, (meta, _) in zip(self._workers[1:], received[1:]):
            for key in sorted(set(first_meta) | set(meta)):
                if meta.get(key) != first_meta.get(key):
                    raise ParameterServerError(
                        f"worker rank {worker} passed {key}={meta.get(key)!r} but worker "
                        f"rank {first} passed {first_meta.get(key)!r}; every worker must "
                        "init with the same tensors and options")
        try:
            self._configure(first_meta, values)
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterServerError(f"invalid init from worker rank {first}: {exc}") from None
        if self._backup is not None and values is not None:
            await self._backup.init(msgpack.packb(first_meta), values)
        clock = self.clock
        if clock is None:  # pragma: no cover - _configure sets it
            raise ParameterServerError("init without a clock")
        wire_staleness = NO_STALENESS_BOUND if clock.max_staleness is None else clock.max_staleness
        ok = encode_header(Kind.OK, 0, wire_staleness)
        await run_all([self._send(w, ShardedStream.REPLY, ok, "answering INIT")
                       for w in self._workers])

    def _configure(self, meta: dict[str, Any], values: np.ndarray | None, *,
                   shard: ServerShard | None = None) -> None:
        """Plan, shard, clock and buffers from the init map ``meta`` (``ValueError``,
        ``KeyError`` or ``TypeError`` if it is not valid; ``ParameterServerError`` if
        ``values`` do not fit). ``shard``: a replica's, taken over as it is."""
        specs = [ParamSpec.from_wire(s) for s in meta["specs"]]
        if meta["num_servers"] != self.roles.num_servers:
            raise ValueError(f"workers expect {meta['num_servers']} servers, the "
                             f"job has {self.roles.num_servers}")
        plan = plan_shards(specs, self.roles.num_servers,
                           bigarray_bound=int(meta["bigarray_bound"]))
        optimizer = optimizer_config_from_dict(meta["optimizer"])
        staleness = meta["max_staleness"]
        clock = StalenessController(len(self._workers),
                                    None if staleness == NO_STALENESS_BOUND else staleness)
        worker_loss = WorkerLoss(meta.get("worker_loss", WorkerLoss.FAIL.value))
        size = plan.server_sizes[self.shard_index]
        dtype = dtype_from_wire(plan.dtype)
        if values is None or values.dtype != dtype or values.shape != (size,):
            got = "nothing" if values is None else f"{values.dtype}{list(values.shape)}"
            raise ParameterServerError(f"worker rank {self._workers[0]} sent {got} as "
                                       f"initial values; server {self.shard_index} holds "
                                       f"{plan.dtype}[{size}]")
        self.plan = plan
        self.shard = ServerShard(optimizer, values) if shard is None else shard
        self.clock = clock
        self._worker_loss = worker_loss
        self._segments = plan_segments(plan, self.shard_index)
        self._grads = [np.empty(size, dtype) for _ in self._workers]

    # -- serving -------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for index, worker in enumerate(self._workers):
                    if self.clock is not None and index not in self.clock.active:
                        continue  # a resumed shard: this worker finished before
                    tg.create_task(self._serve_or_drop(index, worker))
        except BaseExceptionGroup as group:
            raise first_error(group) from None

    async def _aborted(self, worker: int) -> None:
        try:
            raw = await self._ep.recv(worker, self._tag(ShardedStream.ERRMSG),
                                      timeout=min(_NOTIFY_TIMEOUT, self._ep.timeout))
            text = raw.tobytes().decode(errors="replace")
        except NetdistError as exc:
            text = f"(its error text was lost: {exc})"
        raise RankFailure(worker, "worker aborted", ParameterServerError(text))

    async def _serve_or_drop(self, index: int, worker: int) -> None:
        """Serve one worker; with ``WorkerLoss.CONTINUE`` a failure of that worker (lost,
        silent past the timeout, aborted) drops it instead of ending the job."""
        try:
            await self._serve_worker(index, worker)
        except RankFailure as failure:
            if self._worker_loss is not WorkerLoss.CONTINUE or failure.rank != worker:
                raise
            await self._drop(index, f"{failure.what}: {self._ep.describe(failure.error)}")

    async def _drop(self, index: int, reason: str) -> None:
        """Go on without worker ``index`` (``WorkerLoss.CONTINUE``)."""
        clock = self.clock
        if clock is None or index not in clock.active:
            return
        worker = self._workers[index]
        logger.warning("netdist: parameter server rank %d (shard %d) drops worker rank %d: "
                       "%s", self.server, self.shard_index, worker, reason)
        self._dropped.append(worker)
        clock.finish(index)
        if self._backup is not None:
            await self._backup.drop(index)
        await self._advance()

    async def _serve_worker(self, index: int, worker: int) -> None:
        clock = self.clock
        if clock is None:  # pragma: no cover - set by _initialise
            raise ParameterServerError("server used before init")
        while True:
            kind, flags, base, seq = await self._recv_header(worker,
                                                             "waiting for its next request")
            if kind is Kind.DONE:
                clock.finish(index)
                if self._backup is not None:
                    await self._backup.drop(index)
                await self._advance()
                return
            if kind is Kind.ABORT:
                await self._aborted(worker)
            if kind is not Kind.REQUEST or not flags or flags & ~(PUSH | PULL):
                raise RankFailure(worker, "serving", ParameterServerError(
                    f"unexpected {kind.name} message (flags {flags})"))
            if not clock.base_known(index):
                try:
                    clock.report_base(index, base)
                except ParameterServerError as exc:
                    raise RankFailure(worker, "resuming", exc) from None
            if flags & PUSH and seq <= self._applied_seq[index]:
                # a retry of a push this shard applied before its primary was lost: take
                # the gradient off the wire and do not apply it again
                await self._receive_gradient(index, worker, base)
            elif flags & PUSH:
                try:
                    clock.check_push(index, base)
                except ParameterServerError as exc:
                    raise RankFailure(worker, "push", exc) from None
                with self._recorder.span("ps", "serve_push", worker=worker,
                                         shard=self.shard_index, step=seq, base=base,
                                         bytes=self._grads[index].nbytes):
                    # land the gradient first: once pending, another worker's push may
                    # apply it
                    await self._receive_gradient(index, worker, base)
                    self._push_seq[index] = seq
                    clock.on_push(index, base)
                    await self._advance()
            if flags & PULL:
                with self._recorder.span("ps", "serve_pull", worker=worker,
                                         shard=self.shard_index, step=seq,
                                         bytes=self._grads[index].nbytes):
                    await self._answer_pull(index, worker)

    async def _receive_gradient(self, index: int, worker: int, base: int) -> None:
        """Land worker ``index``'s gradient segments in its gradient buffer."""
        grad = self._grads[index]
        await run_all([self._recv(worker, ShardedStream.DATA,
                                  f"receiving gradient of version {base}",
                                  out=grad[seg.offset:seg.offset + seg.size],
                                  index=seg.index)
                       for seg in self._segments])

    async def _advance(self) -> None:
        """Apply every update the staleness rule allows, then wake waiting pulls."""
        clock = self.clock
        if clock is None:  # pragma: no cover
            return
        async with self._apply_lock:
            while True:
                update = clock.next_update()
                if update is None:
                    break
                if self._readers:  # a pull reply is being sent from the shard: let it finish
                    async with self._changed:
                        await self._changed.wait_for(lambda: self._readers == 0)
                    continue
                await self._apply(update)
        async with self._changed:
            self._changed.notify_all()

    async def _apply(self, update: tuple[int, ...]) -> None:
        """Apply one update here and, with a backup, there, before any pull sees it.

        Synchronous training divides by the gradients in the update (every remaining
        worker's, so a dropped worker shrinks the average); the other modes by the
        number of workers, as before. The gradients stay pending (their buffers
        untouched) until the backup has applied them too; meanwhile ``_applying`` holds
        back new pull answers.
        """
        shard, clock = self.shard, self.clock
        if shard is None or clock is None:
            raise ParameterServerError("server used before init")  # pragma: no cover
        grads = [self._grads[w] for w in update]
        divisor = len(update) if clock.max_staleness == 0 else len(self._workers)
        self._applying = True
        try:
            with self._recorder.span("ps", "apply", shard=self.shard_index,
                                     version=clock.version, workers=len(update)):
                shard.apply(grads, divisor)
                if self._backup is not None:
                    records = [UpdateRecord(w, self._push_seq[w], clock.base(w))
                               for w in update]
                    await self._backup.apply(records, grads, clock.version, divisor)
            clock.commit(update)
            for w in update:
                self._applied_seq[w] = self._push_seq[w]
        finally:
            self._applying = False

    async def _answer_pull(self, index: int, worker: int) -> None:
        clock = self.clock
        if clock is None:  # pragma: no cover
            return
        while True:
            try:
                async with asyncio.timeout(self._ep.timeout):
                    async with self._changed:
                        await self._changed.wait_for(
                            lambda: clock.can_pull(index) and not self._applying)
                break
            except TimeoutError:
                # blame the laggard that holds the update back, not the worker waiting
                laggards = sorted((clock.base(w), w) for w in clock.active
                                  if w != index and clock.can_pull(w))
                culprit = self._workers[laggards[0][1]] if laggards else worker
                base = laggards[0][0] if laggards else clock.base(index)
                message = (f"worker rank {worker}'s push waited {self._ep.timeout:.2f}s for "
                           f"worker rank {culprit} (at version {base}; server version "
                           f"{clock.version}, max_staleness={clock.max_staleness})")
                if self._worker_loss is WorkerLoss.CONTINUE and laggards:
                    await self._drop(laggards[0][1], message)
                    continue
                raise RankFailure(culprit, "holding up the others",
                                  NetdistTimeoutError(message)) from None
        self._readers += 1
        try:
            version = clock.on_pull(index)
            await self._send(worker, ShardedStream.REPLY, encode_header(Kind.OK, version),
                             "answering pull")
            params = self.params
            if params is None:  # pragma: no cover - set by _initialise
                raise ParameterServerError("server used before init")
            for seg in self._segments:
                await self._send(worker, ShardedStream.PARAMS,
                                 params[seg.offset:seg.offset + seg.size],
                                 "sending parameters", index=seg.index)
        finally:
            self._readers -= 1
            async with self._changed:
                self._changed.notify_all()
        await self._advance()  # a newer base may release pushes held for this worker

    async def _notify(self, message: str, skip: int | None) -> None:
        """Tell every worker still running why the server stops (best effort)."""
        clock = self.clock
        targets = [w for i, w in enumerate(self._workers) if w != skip and (
            clock is None or i in clock.active)]
        text = np.frombuffer(message.encode(), dtype=np.uint8)
        culprit = -1 if skip is None else skip
        timeout = min(_NOTIFY_TIMEOUT, self._ep.timeout)

        async def one(worker: int) -> None:
            try:
                await self._ep.send(worker, encode_header(Kind.ERROR, culprit),
                                    self._tag(ShardedStream.REPLY), timeout=timeout)
                await self._ep.send(worker, text, self._tag(ShardedStream.ERRMSG),
                                    timeout=timeout)
            except NetdistError:
                pass  # unreachable: it sees its own transport error

        await asyncio.gather(*(one(w) for w in targets))


async def serve(group: GroupLike | Transport, *, num_servers: int,
                timeout: float | None = None, tags: TagRange | None = None,
                replicas: int = 0) -> ServerReport:
    """Run one dedicated server on this rank until every worker is done."""
    return await PSServer(group, num_servers=num_servers, timeout=timeout,
                          tags=tags, replicas=replicas).run()
