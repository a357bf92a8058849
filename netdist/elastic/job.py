"""``ElasticJob``: training that carries on when members are lost and grows when they join.

A job's membership is numbered (epochs, ``netdist.elastic.membership``). Each epoch has
its own authenticated transport and group among its members; a step is a transaction:

1. the step function computes on this member's share of the batch and runs its
   collectives on the epoch's group (``StepContext.all_reduce``);
2. every member then contributes to one small *vote* all-reduce. It completes on a member
   only once every member has reached it, i.e. once every member's collectives of the
   step are complete, so the reduced results are the same everywhere;
3. a member whose vote completed commits: its ``on_commit`` actions run (the optimizer
   update), the step count and the sampler advance.

When a member is lost (killed, stopped, cut off) the survivors' collectives fail
(``PeerLostError`` from the transport: at once for a killed process, within
``failure_timeout`` for a silent one). Each survivor aborts the epoch's transport and
asks the members of the epoch, in rank order, for the agreement on the next epoch; the
first that answers as a member leads it. The leader tells every member that the epoch
is over (so none waits out its own liveness window), waits for the members not known
lost (bounded by ``failure_timeout``), requires a strict majority of the old membership
(``QuorumLostError`` on a minority side), numbers the new epoch, hosts its rendezvous
and answers everyone with the same membership. No process is special: when the first
member is the one lost, the next one leads.

The interrupted step goes on in the new epoch when every survivor was at the same point
of it (all in its first collective, having prepared it in the same epoch: they finish
that collective without the lost member's share, whose samples go back to the sampler;
or all voting: the step commits); otherwise it runs again. When a vote completed on
some members and failed on others, the next epoch resolves it: the members compare their
committed step (``netdist.elastic.transfer``), the newest wins, and members behind fetch
its state, so every member starts the next step from the same bits.

A new or restarted process (``ElasticConfig.joining``) asks any seed endpoint, is
redirected to the leader, and is admitted at the next step boundary: the leader's vote
tells every member that someone waits, so they all form the next epoch after committing,
and the joiner fetches the state from two members at once, verified by their hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdist.collectives.group import Group
from netdist.config import ConnectMode
from netdist.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    ElasticError,
    NetdistTimeoutError,
    PeerLostError,
    QuorumLostError,
    RendezvousError,
    TransportError,
)
from netdist.transport.tcp import TcpTransport
from netdist.types import ReduceOp
from netdist.wire import FrameKind

from netdist.elastic.config import ElasticConfig
from netdist.elastic.endpoint import EndpointIdentity, EndpointServer, Reply, ask
from netdist.elastic.membership import Membership, has_majority, next_order, parse_endpoint
from netdist.elastic.sampler import ElasticSampler
from netdist.elastic.state import ElasticState
from netdist.elastic.transfer import SyncReport, synchronize_state

__all__ = ["ElasticJob", "StepContext", "StepReport", "EpochChange", "StepDiscarded"]

logger = logging.getLogger("netdist.elastic")

MEMBERSHIP_ERRORS: tuple[type[BaseException], ...] = (
    TransportError, NetdistTimeoutError, CollectiveError, RendezvousError)
"""Errors that mean "the epoch is broken", not a bug: the step is retried in a new epoch."""

_SAMPLER_ENTRY = "netdist.elastic/sampler"


class StepDiscarded(ElasticError):
    """The step's attempt was discarded because the membership changed under it; the
    step runs again (``run_step`` does this; a step function need not catch it)."""


class Phase(enum.Enum):
    """Where this member is."""

    STARTING = "starting"
    ACTIVE = "active"
    REFORMING = "reforming"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class EpochChange:
    """One change of membership as this member saw it."""

    epoch: int
    slots: tuple[int, ...]
    reason: str
    seconds: float
    """From the failure (or the decision to grow) to the new epoch's first step."""
    sync: SyncReport | None = None


@dataclass(frozen=True, slots=True)
class StepReport:
    """What ``run_step`` did: the committed step, its epoch and how many tries it took."""

    step: int
    epoch: int
    world_size: int
    attempts: int
    seconds: float


@dataclass
class StepContext:
    """One attempt at one step, handed to the step function."""

    job: ElasticJob
    group: Group
    batch: np.ndarray | None
    """This member's sample ids (from the job's sampler; None without one)."""
    global_count: int
    """Samples of the whole step, all members together (0 without a sampler). After a
    resumed step, only the samples of the members that contributed."""
    started: float = 0.0
    """Loop time at which this attempt began (the job measures whole steps)."""
    prepared_in: int = 0
    """The epoch whose membership split the samples of this attempt."""
    _commit: list[Callable[[], None]] = field(default_factory=list)
    _calls: int = 0
    skipped: np.ndarray | None = None
    """Ids of this step no member used (a lost member's share, after a resumed step)."""

    @property
    def rank(self) -> int:
        """This member's rank in the epoch."""
        return self.group.rank

    @property
    def world_size(self) -> int:
        """How many members the epoch has."""
        return self.group.world_size

    @property
    def step(self) -> int:
        """The step being attempted (the number of steps committed before it)."""
        return self.job.step

    @property
    def epoch(self) -> int:
        """The epoch of this attempt."""
        return self.job.epoch

    async def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        """All-reduce ``array`` (in place) on the epoch's group.

        When a member is lost during the step's *first* collective, the survivors agree
        on a new epoch and, if every one of them was waiting in this same collective,
        finish it among themselves without the lost member's share (its sample ids go
        back to the sampler, ``global_count`` drops to the samples that were used): the
        computation of the step is not thrown away. Otherwise the step is discarded
        (``StepDiscarded``) and run again.
        """
        job = self.job
        call = self._calls
        self._calls += 1
        job._position = ("reduce", call, self.prepared_in)
        backup = np.array(array, copy=True) if call == 0 and isinstance(array, np.ndarray) \
            else None
        while True:
            try:
                return await self.group.all_reduce(array, op, timeout=job.op_timeout)
            except MEMBERSHIP_ERRORS as exc:
                if isinstance(exc, CollectiveMismatchError):
                    raise
                await job.epoch_failed(exc)
                await job._ensure_active()
                if backup is None or not job._resume(self, ("reduce", call, self.prepared_in)):
                    raise StepDiscarded(f"step {job.step} is run again in epoch {job.epoch}"
                                        ) from exc
                np.copyto(array, backup)

    def on_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` when (and only when) the step commits: the optimizer update."""
        self._commit.append(action)


@dataclass(slots=True)
class _Arrival:
    slot: int
    endpoint: str
    epoch: int
    answer: asyncio.Future[Reply]


class _Formation:
    """An agreement this member leads: who is expected, who arrived, who joins."""

    def __init__(self, base: Membership | None, expected: set[int], deadline: float,
                 initial: tuple[int, ...]) -> None:
        self.base = base
        self.base_epoch = 0 if base is None else base.epoch
        self.previous: tuple[int, ...] = initial if base is None else base.slots
        self.expected = expected
        self.deadline = deadline
        self.lost: set[int] = set()
        self.arrivals: dict[int, _Arrival] = {}
        self.joiners: dict[int, _Arrival] = {}
        self.changed = asyncio.Event()
        self.extended = False

    def waiting_for(self) -> set[int]:
        return self.expected - self.lost - set(self.arrivals)


class ElasticJob:
    """An elastic member; ``job = await ElasticJob.start(config, state)``, then
    ``await job.run_step(fn)`` per step, and ``await job.aclose()`` (or ``async with``)."""

    def __init__(self, config: ElasticConfig, state: ElasticState,
                 sampler: ElasticSampler | None) -> None:
        self.config = config
        self.state = state
        self.sampler = sampler
        if sampler is not None:
            state.add(_SAMPLER_ENTRY, sampler.state_array, sampler.load_state_array)
        self.slot = config.slot
        self.step = -1 if config.joining else 0
        """Steps committed; -1 until a joiner has fetched the state."""
        self.membership: Membership | None = None
        self.transport: TcpTransport | None = None
        self.group: Group | None = None
        self.phase = Phase.STARTING
        self.changes: list[EpochChange] = []
        """Every membership this member adopted, with how long the change took."""
        self.discarded = 0
        """Step attempts interrupted because the membership changed under them."""
        self.resumed = 0
        """Of those, the ones that went on in the new epoch instead of starting over."""
        self._loop = asyncio.get_running_loop()
        self._identity = EndpointIdentity(config.base.job_id, config.base.token, config.slot,
                                          config.base.insecure)
        self._endpoint: EndpointServer | None = None
        self._formation: _Formation | None = None
        self._leader_transport: asyncio.Task[TcpTransport] | None = None
        self._pending: dict[int, _Arrival] = {}
        self._closing: set[asyncio.Task[None]] = set()
        """Epoch transports still closing (``_close_in_background``)."""
        self._lost: set[int] = set()
        """Slots this member believes gone: a hint for the leader, who need not wait."""
        self._unreachable: set[int] = set()
        """Candidates that did not answer during the current agreement: skipped."""
        self._joining = config.joining
        self._grow = False
        self._stale = False
        self._broken_since: float | None = None
        self._reason = "start"
        self._step_times: list[float] = []
        self._why = "start"
        """Why this member asks for an agreement: "failure" or "grow" (or "start")."""
        self._position: tuple[str, int, int] | None = None
        """Where this member is in its step: ("reduce", k, e) in collective k of a step
        prepared in epoch e (whose split of the samples it computed), ("vote", 0, e)."""
        self._batch_ids: list[int] = []
        self._positions: list[Any] = []

    # -- construction --------------------------------------------------------------------

    @classmethod
    async def start(cls, config: ElasticConfig, state: ElasticState, *,
                    sampler: ElasticSampler | None = None) -> ElasticJob:
        """Start this member's endpoint and join the job (form the first epoch with the
        other first members, or join the running job as a restart or spare)."""
        self = cls(config, state, sampler)
        try:
            if not config.joining and config.slot == 0:
                initial = tuple(range(config.initial_size))
                self._formation = _Formation(
                    None, set(initial), self._loop.time() + config.base.join_timeout, initial)
                self._spawn_lead(self._formation)
            self._endpoint = await EndpointServer.start(
                self._identity, config.host, config.port, self._on_request,
                admission=config.base.admission, handshake_timeout=config.handshake_timeout)
            self._broken_since = self._loop.time()
            await self._ensure_active()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aenter__(self) -> ElasticJob:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- public state --------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current membership's number (0 before the first)."""
        return 0 if self.membership is None else self.membership.epoch

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch."""
        return self._member_of().rank_of(self.slot)

    @property
    def world_size(self) -> int:
        """Members in the current epoch."""
        return self._member_of().size

    def _member_of(self) -> Membership:
        """The current membership (``ElasticError`` before the first one)."""
        if self.membership is None:
            raise ElasticError(f"slot {self.slot} is not a member of an epoch yet")
        return self.membership

    def _active_group(self) -> Group:
        """The current epoch's group (``ElasticError`` between epochs)."""
        if self.group is None:
            raise ElasticError(f"slot {self.slot} is between epochs (epoch {self.epoch} "
                               "ended)")
        return self.group

    @property
    def op_timeout(self) -> float:
        """The bound on one collective inside a step (see ``ElasticConfig``)."""
        if not self._step_times:
            return self.config.failure_timeout + self.config.base.timeout
        return 2 * self.config.failure_timeout + 3 * max(self._step_times[-20:])

    # -- steps ---------------------------------------------------------------------------

    async def run_step(self, fn: Callable[[StepContext], Awaitable[None]]) -> StepReport:
        """Run one step to commit, retrying it in a new epoch when a member is lost.

        ``fn(ctx)`` computes this member's part and runs the step's collectives through
        ``ctx``; it is called again (with the new membership and batch) when an attempt is
        discarded, so it must not change the state itself: it registers the update with
        ``ctx.on_commit``.
        """
        attempts = 0
        while True:
            attempts += 1
            ctx = await self.prepare_step()
            started = self._loop.time()
            try:
                await fn(ctx)
            except StepDiscarded:
                continue
            except MEMBERSHIP_ERRORS as exc:
                if isinstance(exc, CollectiveMismatchError):
                    raise
                await self.epoch_failed(exc)
                continue
            if await self.finish_step(ctx):
                return StepReport(self.step - 1, self.epoch, ctx.world_size, attempts,
                                  self._loop.time() - started)

    async def prepare_step(self) -> StepContext:
        """Make sure an epoch is active (forming one if needed); the next attempt's context."""
        self._position = None
        self._batch_ids = []
        await self._ensure_active()
        group = self._active_group()
        batch = None
        count = 0
        if self.sampler is not None:
            count = len(self.sampler.global_ids())
            batch = self.sampler.batch(self.rank, self.world_size)
            self._batch_ids = batch.tolist()
        return StepContext(self, group, batch, count, started=self._loop.time(),
                           prepared_in=self.epoch)

    async def finish_step(self, ctx: StepContext) -> bool:
        """The vote, then the commit; False (the attempt is discarded) if the epoch broke."""
        self._position = ("vote", 0, ctx.prepared_in)
        while True:
            waiting = float(len(self._pending)) if self._leads() else 0.0
            try:
                vote = await self._active_group().all_reduce(np.array([1.0, waiting]),
                                                   timeout=self.op_timeout)
                break
            except MEMBERSHIP_ERRORS as exc:
                if isinstance(exc, CollectiveMismatchError):
                    raise
                await self.epoch_failed(exc)
                await self._ensure_active()
                # every survivor was voting: each one's collectives of the step completed
                # with every member's share, so the step commits in the new epoch
                if not self._resume(ctx, ("vote", 0, ctx.prepared_in)):
                    return False
        self._position = None
        with self._span("commit", step=self.step, epoch=self.epoch,
                        world_size=ctx.world_size):
            for action in ctx._commit:
                action()
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance(ctx.skipped)
        self._step_times.append(self._loop.time() - ctx.started)
        if vote[1] > 0:
            self._grow = True
            self._reason = f"{int(vote[1])} joining"
        return True

    def _span(self, name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """A trace span (category ``"elastic"``) on this epoch's transport's recorder."""
        transport = self.transport
        if transport is None:
            return contextlib.nullcontext(args)
        return transport.recorder.span("elastic", name, **args)

    async def epoch_failed(self, exc: BaseException) -> None:
        """The epoch is broken (``exc`` says how): abort its transport (which wakes every
        other member) and note whom to skip when asking for the next agreement."""
        self.discarded += 1
        self._why = "failure"
        if self._broken_since is None:
            self._broken_since = self._loop.time()
        lost = _lost_peer(exc)
        if lost is not None and self.membership is not None:
            self._lost.add(self.membership.slots[lost])
            self._reason = f"slot {self.membership.slots[lost]} lost"
        logger.warning("netdist elastic: slot %d: epoch %d failed: %s", self.slot, self.epoch,
                       _short(exc))
        await self._drop_epoch(exc)

    def _resume(self, ctx: StepContext, position: tuple[str, int, int]) -> bool:
        """Whether the interrupted step goes on in the new epoch (see ``all_reduce``).

        Only if every member of the new epoch was at the same step and the same point
        of it, having prepared the step in the same epoch (so their shares of the
        samples are one split: disjoint): all waiting in the step's first collective (their computations stand;
        the lost members' shares are handed back to the sampler), or all voting.
        """
        wanted = [self.step, list(position)]
        if not self._positions or any(info[:2] != wanted for info in self._positions):
            return False
        ctx.group = self._active_group()
        if position[0] == "reduce":
            if position[1] != 0 or self.sampler is None:
                return position[1] == 0 and self.sampler is None
            used = {int(i) for info in self._positions for i in info[2]}
            ids = self.sampler.global_ids()
            ctx.skipped = ids[~np.isin(ids, list(used))]
            ctx.global_count = len(ids) - len(ctx.skipped)
        self.resumed += 1
        return True

    # -- epochs --------------------------------------------------------------------------

    async def _abort_epoch(self, why: str) -> None:
        """From the endpoint: fail the epoch's transport, so the training loop's waits end
        now; the loop then drops the epoch itself (``epoch_failed``)."""
        if self.transport is not None:
            self._close_in_background(self.transport, why)

    def _close_in_background(self, transport: TcpTransport,
                             why: BaseException | str | None,
                             group: Group | None = None) -> None:
        """Close ``group`` (its shared memory) and ``transport`` without waiting: the
        transport's waits fail at once, and what it still had to deliver to a silent
        peer must not hold up the next agreement (a close waits up to a liveness window
        for that); ``aclose`` collects the task."""

        async def close() -> None:
            if group is not None:
                with contextlib.suppress(Exception):
                    await group.aclose()
            if why is None:
                await transport.aclose()
            else:
                await transport.abort(why)

        closing = self._loop.create_task(close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        closing.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _drop_epoch(self, why: BaseException | str | None) -> None:
        transport, group = self.transport, self.group
        self.transport = self.group = None
        if self.phase is Phase.ACTIVE:
            self.phase = Phase.REFORMING
        if transport is not None:
            self._close_in_background(transport, why, group)

    async def _ensure_active(self) -> None:
        if self.phase is Phase.CLOSED:
            raise ElasticError(f"slot {self.slot}: the elastic job is closed")
        if self._grow or self._stale:
            if self._broken_since is None:
                self._broken_since = self._loop.time()
            grow, self._grow = self._grow, False
            self._why = "grow" if grow and not self._stale else "failure"
            if self._stale:
                self._joining = True
            await self._drop_epoch(None if grow and not self._stale else "left the epoch")
        if self.phase is Phase.ACTIVE and self.group is not None:
            return
        deadline = self._loop.time() + self.config.base.join_timeout
        while True:
            reply = await self._agree(deadline)
            try:
                await self._adopt(reply)
                return
            except MEMBERSHIP_ERRORS as exc:
                if isinstance(exc, CollectiveMismatchError):
                    raise
                logger.warning("netdist elastic: slot %d: epoch %d did not start: %s",
                               self.slot, self.epoch, _short(exc))
                lost = _lost_peer(exc)
                if lost is not None and self.membership is not None:
                    self._lost.add(self.membership.slots[lost])
                await self._drop_epoch(exc)
                if self._loop.time() > deadline:
                    raise

    async def _adopt(self, reply: Reply) -> None:
        fields = reply.fields
        membership = Membership(int(fields["epoch"]), tuple(fields["slots"]),
                                tuple(fields["endpoints"]))
        self.membership = membership
        self._lost.clear()
        self._stale = False
        self._joining = False  # a member of this epoch now, even before it has the state
        rank = membership.rank_of(self.slot)
        host, port = fields["coordinator"]
        cfg = self.config
        base = cfg.base.replace(
            rank=rank, world_size=membership.size, coordinator=(host, port),
            job_id=f"{cfg.base.job_id}/epoch{membership.epoch}",
            heartbeat_interval=cfg.heartbeat_interval, heartbeat_misses=5,
            connect_timeout=2 * cfg.failure_timeout, connect=ConnectMode.EAGER)
        if rank == 0 and self._leader_transport is not None:
            task, self._leader_transport = self._leader_transport, None
            self.transport = await task
        else:
            self.transport = await TcpTransport.connect(base)
        self.group = Group(self.transport, timeout=self.op_timeout)
        def overwriting() -> None:
            self.step = -1  # no valid state until the fetched one is verified

        with self._span("epoch", epoch=membership.epoch, world_size=membership.size,
                        rank=rank, reason=self._reason) as args:
            report = await synchronize_state(self.group, self.state, self.step, overwriting)
            if report.step != self.step:
                self.step = report.step
                self._position = None
            # where every member is in its step, for a step that may resume (``_resume``)
            self._positions = await self.group.all_gather_object(
                [self.step, None if self._position is None else list(self._position),
                 self._batch_ids if self._position is not None else []])
            args["step"] = self.step
        self.phase = Phase.ACTIVE
        began = self._broken_since if self._broken_since is not None else self._loop.time()
        self._broken_since = None
        change = EpochChange(membership.epoch, membership.slots, self._reason,
                             self._loop.time() - began, report)
        self.changes.append(change)
        logger.info("netdist elastic: slot %d: %s, rank %d, step %d (%s, %.2fs)", self.slot,
                    membership, rank, self.step, self._reason, change.seconds)
        self._reason = "member lost"

    # -- asking for an agreement ---------------------------------------------------------

    def _request(self) -> dict[str, Any]:
        if self._joining:
            kind = "join"
        else:
            kind = "reform"
        return {"kind": kind, "slot": self.slot, "epoch": self.epoch, "why": self._why,
                "lost": sorted(self._lost), "step": self.step,
                "endpoint": self._endpoint.address if self._endpoint else self.config.endpoint}

    def _candidates(self) -> list[tuple[int, str]]:
        if self._joining:
            return [(slot, seed) for slot, seed in enumerate(self.config.seeds)
                    if slot != self.slot]
        if self.membership is None:  # forming the first epoch: slot 0 leads it
            return [(0, self.config.seeds[0])]
        # every member in order, the ones believed lost included (a refused connection
        # costs nothing, and a member that merely aborted its transport is alive and
        # may be the leader); only those that did not answer this agreement are skipped
        return [(slot, self.membership.endpoint_of(slot)) for slot in self.membership.slots
                if slot not in self._unreachable]

    async def _agree(self, deadline: float) -> Reply:
        pause = 0.02
        cfg = self.config
        self._unreachable.clear()
        no_quorum: QuorumLostError | None = None
        probe_until = 0.0
        while True:
            if no_quorum is not None and self._loop.time() > probe_until:
                raise no_quorum
            redirect: str | None = None
            for slot, endpoint in self._candidates():
                if redirect is not None:
                    break
                if slot == self.slot:
                    if self._joining:
                        continue
                    reply = await self._arrive_locally(self._request())
                else:
                    try:
                        reply = await ask(endpoint, self._identity, self._request(),
                                          handshake_timeout=cfg.handshake_timeout,
                                          reply_timeout=cfg.base.join_timeout)
                    except (TransportError, NetdistTimeoutError) as exc:
                        if isinstance(exc, AuthenticationError):
                            raise
                        if not self._joining and self.membership is not None:
                            self._lost.add(slot)
                            self._unreachable.add(slot)
                        logger.info("netdist elastic: slot %d: slot %d at %s did not answer:"
                                    " %s", self.slot, slot, endpoint, _short(exc))
                        continue
                if reply.kind == FrameKind.OK and reply.fields.get("op") == "epoch":
                    return reply
                if reply.kind == FrameKind.OK and reply.fields.get("op") == "redirect":
                    redirect = str(reply.fields["endpoint"])
                    break
                code = reply.code
                logger.info("netdist elastic: slot %d: slot %d answered %s: %s", self.slot,
                            slot, code, reply.fields.get("reason"))
                if code == "no_quorum":
                    if no_quorum is None:
                        # Before giving up, ask the rest of the job as a joiner: this
                        # member may only have been cut off for a while (stopped) while
                        # the others went on; it then joins them. A true minority
                        # reaches nobody and stops.
                        no_quorum = QuorumLostError(
                            f"slot {self.slot}: {reply.fields.get('reason', 'no quorum')}",
                            tuple(reply.fields.get("members", ())))
                        probe_until = self._loop.time() + 2 * cfg.failure_timeout
                        self._joining = True
                    break
                if code == "finished":
                    raise ElasticError(f"slot {self.slot}: {reply.fields.get('reason')}")
                if code == "stale":
                    self._joining = True
                    break
                if code in ("stale_leader", "joining"):
                    self._unreachable.add(slot)
                    continue
                break  # "retry": the member is itself between epochs
            if redirect is not None:
                try:
                    reply = await ask(redirect, self._identity, self._request(),
                                      handshake_timeout=cfg.handshake_timeout,
                                      reply_timeout=cfg.base.join_timeout)
                    if reply.kind == FrameKind.OK and reply.fields.get("op") == "epoch":
                        return reply
                except (TransportError, NetdistTimeoutError) as exc:
                    if isinstance(exc, AuthenticationError):
                        raise
            if self._loop.time() + pause > deadline:
                raise NetdistTimeoutError(
                    f"slot {self.slot}: no member answered with a membership within "
                    f"{cfg.base.join_timeout:.1f}s (asked {[e for _, e in self._candidates()]})")
            await asyncio.sleep(pause)  # back off before asking again; not synchronisation
            pause = min(pause * 2, 0.5)

    async def _arrive_locally(self, request: dict[str, Any]) -> Reply:
        formation = self._formation or self._begin_formation(str(request.get("why")))
        return await self._arrive(formation, self.slot, request)

    # -- leading an agreement ------------------------------------------------------------

    def _leads(self) -> bool:
        return self.membership is not None and self.membership.leader == self.slot

    def _begin_formation(self, why: str) -> _Formation:
        base = self._member_of()
        formation = _Formation(base, set(base.slots) - self._lost,
                               self._loop.time() + 1.5 * self.config.failure_timeout, ())
        formation.lost |= self._lost
        self._formation = formation
        for slot, arrival in self._pending.items():
            formation.joiners[slot] = arrival
        self._pending.clear()
        self._spawn_lead(formation)
        if why == "failure":
            # A member blocked on a silent peer would notice only when its own liveness
            # window ends (up to a window later than the first to notice): tell every
            # member that the epoch is over, so its waits fail now and it comes here.
            for slot in base.slots:
                if slot != self.slot and slot not in self._lost:
                    task = self._loop.create_task(self._abandon(base, slot))
                    task.add_done_callback(_log_failure)
        return formation

    async def _abandon(self, base: Membership, slot: int) -> None:
        """Tell member ``slot`` that epoch ``base.epoch`` is over (best effort)."""
        fields = {"kind": "abandon", "slot": self.slot, "epoch": base.epoch, "why": "failure",
                  "lost": [], "step": self.step, "endpoint": self.config.endpoint}
        with contextlib.suppress(TransportError, NetdistTimeoutError):
            await ask(base.endpoint_of(slot), self._identity, fields,
                      handshake_timeout=self.config.handshake_timeout,
                      reply_timeout=self.config.handshake_timeout)

    def _spawn_lead(self, formation: _Formation) -> None:
        task = self._loop.create_task(self._lead(formation))
        task.add_done_callback(_log_failure)

    async def _on_request(self, slot: int, fields: dict[str, Any]) -> Reply:
        """The endpoint's handler (see the module docstring for the cases)."""
        try:
            req_epoch = int(fields["epoch"])
            kind = str(fields["kind"])
            str(fields["endpoint"])
        except (KeyError, TypeError, ValueError):
            return _error("bad_request", "malformed request")
        if kind == "abandon":
            if (self.phase is Phase.ACTIVE and self.membership is not None
                    and self.membership.epoch == req_epoch and self._formation is None):
                if self._broken_since is None:
                    self._broken_since = self._loop.time()
                self._why = "failure"
                await self._abort_epoch(f"slot {slot} leads the agreement after a failure")
            return Reply(FrameKind.OK, {"op": "abandoned"})
        formation = self._formation
        if formation is not None:
            if req_epoch > formation.base_epoch:
                return _error("stale_leader", f"slot {self.slot} is at epoch "
                              f"{formation.base_epoch}, behind epoch {req_epoch}")
            return await self._arrive(formation, slot, fields)
        if self.phase is Phase.ACTIVE and self.membership is not None:
            mine = self.membership.epoch
            if req_epoch > mine:
                self._stale = True
                await self._abort_epoch(f"slot {slot} is at a newer epoch")
                return _error("stale_leader", f"slot {self.slot} is behind (epoch {mine})")
            if kind == "join" or req_epoch < mine or slot not in self.membership.slots:
                if not self._leads():
                    return Reply(FrameKind.OK, {"op": "redirect", "endpoint":
                                                self.membership.endpoint_of(
                                                    self.membership.leader)})
                arrival = _Arrival(slot, str(fields["endpoint"]), req_epoch,
                                   self._loop.create_future())
                self._pending[slot] = arrival
                logger.info("netdist elastic: slot %d waits to join at the next step", slot)
                try:
                    return await arrival.answer
                finally:
                    if self._pending.get(slot) is arrival:
                        del self._pending[slot]
            # a member asks for the next epoch (it lost someone, or joiners wait): lead
            # it. This member's own epoch fails on its own (the asker aborted its
            # transport, which every member is connected to) or ends after its vote.
            self._lost.update(int(s) for s in fields.get("lost", ()))
            if self._broken_since is None:
                self._broken_since = self._loop.time()
            formation = self._begin_formation(str(fields.get("why")))
            return await self._arrive(formation, slot, fields)
        if self._joining or self.membership is None:
            # a restarted process at a member's old slot: not a member, cannot lead
            return _error("joining", f"slot {self.slot} is joining, not a member")
        if req_epoch > self.membership.epoch:
            return _error("stale_leader", f"slot {self.slot} is behind (epoch "
                          f"{self.membership.epoch})")
        return _error("retry", f"slot {self.slot} is between epochs")

    async def _arrive(self, formation: _Formation, slot: int,
                      fields: dict[str, Any]) -> Reply:
        arrival = _Arrival(slot, str(fields["endpoint"]), int(fields["epoch"]),
                           self._loop.create_future())
        member = (fields.get("kind") != "join" and slot in formation.previous
                  and arrival.epoch == formation.base_epoch)
        (formation.arrivals if member else formation.joiners)[slot] = arrival
        formation.lost.update(int(s) for s in fields.get("lost", ()) if s != slot)
        formation.changed.set()
        try:
            return await arrival.answer
        finally:
            book = formation.arrivals if member else formation.joiners
            if book.get(slot) is arrival and not arrival.answer.done():
                del book[slot]
                formation.changed.set()

    async def _lead(self, formation: _Formation) -> None:
        """Wait for the expected members (bounded), decide, and answer everyone."""
        try:
            while True:
                formation.changed.clear()
                remaining = formation.deadline - self._loop.time()
                here = self.slot in formation.arrivals or formation.base is None
                # decide early only with everyone expected and a majority: a wrong
                # "lost" hint must not end an agreement that could still reach one
                ready = not formation.waiting_for() and (
                    formation.base is None
                    or has_majority(formation.previous, formation.arrivals))
                if here and remaining <= 0 and not ready and formation.waiting_for() \
                        and not formation.extended and formation.base is not None:
                    # no majority yet, but members not known lost may still come (one
                    # that waited on a silent peer notices up to a window later)
                    formation.extended = True
                    formation.deadline += self.config.failure_timeout
                    continue
                if here and (ready or remaining <= 0):
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(remaining, 0.05) if here else None):
                        await formation.changed.wait()
            self._decide(formation)
        except BaseException as exc:
            for arrival in (*formation.arrivals.values(), *formation.joiners.values()):
                if not arrival.answer.done():
                    arrival.answer.set_exception(exc if isinstance(exc, Exception)
                                                 else ElasticError("agreement cancelled"))
            raise
        finally:
            if self._formation is formation:
                self._formation = None

    def _decide(self, formation: _Formation) -> None:
        previous = formation.previous
        survivors = [s for s in previous if s in formation.arrivals]
        everyone = {**formation.joiners, **formation.arrivals}
        if formation.base is None:
            missing = sorted(set(previous) - set(survivors))
            if missing:
                self._refuse_all(formation, f"the first membership needs slots {list(previous)}"
                                 f"; slots {missing} never arrived within "
                                 f"{self.config.base.join_timeout:.1f}s")
                return
        elif not has_majority(previous, survivors):
            self._refuse_all(formation, f"only slots {survivors} of epoch "
                             f"{formation.base_epoch}'s {list(previous)} could agree: "
                             "not a strict majority, so this side stops")
            return
        order = next_order(previous, survivors, formation.joiners)
        if len(order) < self.config.min_members:
            self._refuse_all(formation, f"{len(order)} members left, fewer than "
                             f"NETDIST_ELASTIC_MIN={self.config.min_members}")
            return
        epoch = max([formation.base_epoch] + [a.epoch for a in everyone.values()]) + 1
        endpoints = tuple(everyone[s].endpoint for s in order)
        leader_host = parse_endpoint(endpoints[0])[0]
        if order[0] != self.slot:  # pragma: no cover - the leader is the first survivor
            raise AssertionError(f"leader {self.slot} is not first in {order}")
        ready: asyncio.Future[tuple[str, int]] = self._loop.create_future()
        cfg = self.config
        base = cfg.base.replace(
            rank=0, world_size=len(order), coordinator=(leader_host, 0),
            job_id=f"{cfg.base.job_id}/epoch{epoch}",
            heartbeat_interval=cfg.heartbeat_interval, heartbeat_misses=5,
            connect_timeout=2 * cfg.failure_timeout, connect=ConnectMode.EAGER)

        def on_ready(address: tuple[str, int]) -> None:
            if not ready.done():
                ready.set_result(address)

        connect = self._loop.create_task(TcpTransport.connect(base,
                                                              on_coordinator_ready=on_ready))
        self._leader_transport = connect

        def answer(_: object) -> None:
            if ready.cancelled() or ready.exception() is not None:
                return
            host, port = ready.result()
            reply = Reply(FrameKind.OK, {"op": "epoch", "epoch": epoch, "slots": list(order),
                                         "endpoints": list(endpoints),
                                         "coordinator": [leader_host, port]})
            for slot in order:
                if not everyone[slot].answer.done():
                    everyone[slot].answer.set_result(reply)

        def failed(task: asyncio.Task[TcpTransport]) -> None:
            if not ready.done():
                exc = task.exception() if not task.cancelled() else None
                ready.set_exception(exc or ElasticError("the epoch's rendezvous was cancelled"))
                for slot in order:
                    if not everyone[slot].answer.done():
                        everyone[slot].answer.set_exception(
                            ElasticError(f"the rendezvous of epoch {epoch} failed: {exc}"))

        ready.add_done_callback(answer)
        connect.add_done_callback(failed)
        logger.info("netdist elastic: slot %d leads epoch %d: slots %s", self.slot, epoch,
                    list(order))

    def _refuse_all(self, formation: _Formation, reason: str) -> None:
        logger.error("netdist elastic: slot %d: %s", self.slot, reason)
        reply = _error("no_quorum", reason)
        reply.fields["members"] = sorted(formation.arrivals)
        for arrival in (*formation.arrivals.values(), *formation.joiners.values()):
            if not arrival.answer.done():
                arrival.answer.set_result(reply)

    # -- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Leave the job: close the epoch's transport and the endpoint; idempotent."""
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        finished = _error("finished", f"the job ended (slot {self.slot} left at step "
                          f"{self.step}) before this process could join it")
        for arrival in list(self._pending.values()):
            if not arrival.answer.done():
                arrival.answer.set_result(finished)
        await self._drop_epoch(None)
        if self._leader_transport is not None:
            self._leader_transport.cancel()
            with contextlib.suppress(BaseException):
                transport = await self._leader_transport
                await transport.aclose()
        if self._endpoint is not None:
            await self._endpoint.aclose()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=2 * self.config.failure_timeout)


def _error(code: str, reason: str) -> Reply:
    return Reply(FrameKind.ERROR, {"code": code, "reason": reason})


def _lost_peer(exc: BaseException) -> int | None:
    """The rank whose loss broke the epoch, if ``exc`` (or its cause) names one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerLostError):
            # a rank that aborted its transport or closed it is alive (it failed its
            # epoch, or left after a commit): only a silent or vanished one is lost
            reason = current.origin_reason
            alive = (reason.startswith(f"rank {current.origin_rank} aborted")
                     or "closed its transport" in reason)
            return None if alive else current.origin_rank
        if isinstance(current, BaseExceptionGroup):
            for inner in current.exceptions:
                found = _lost_peer(inner)
                if found is not None:
                    return found
        current = current.__cause__ or current.__context__
    return None


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) < 200 else text[:197] + "..."


def _log_failure(task: asyncio.Task[Any]) -> None:
    error = None if task.cancelled() else task.exception()
    if error is not None:
        logger.error("netdist elastic: agreement failed: %s", _short(error))


