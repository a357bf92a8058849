"""PURE pipeline schedules: the list of actions every stage performs for one mini-batch.

A schedule is computed up front, for every stage, as a tuple of ``Action``s; the runtime
(``netdist.parallel.pipeline``) only executes it. Because the order is fixed before any
byte moves, it can be checked in one process: ``simulate`` runs all stages' lists together
with the runtime's semantics and proves that nothing deadlocks, that every send is matched
by exactly one receive, and how many micro-batches' activations each stage holds at once.

Semantics (the contract between this module and the runtime):

- ``RECV_ACTIVATION i`` / ``RECV_GRAD i`` block until that message has been sent;
- ``SEND_ACTIVATION i`` / ``SEND_GRAD i`` never block: the runtime posts them as
  background tasks and awaits them at the end of the step, so a stage keeps computing
  while its bytes travel (the "send and receive concurrently" of Megatron's
  ``send_forward_recv_backward``);
- ``FORWARD i`` stashes micro-batch ``i``'s activations (its ``ctx``) until
  ``BACKWARD i`` frees them; the last stage's ``FORWARD`` includes the loss.

Schedules, for ``p`` stages and ``m`` micro-batches, stage ``s``:

- GPipe: ``F0 .. F(m-1)`` then ``B0 .. B(m-1)``. Every stage stashes all ``m``.
- 1F1B (PipeDream-Flush): ``w = min(p - 1 - s, m)`` warm-up forwards, then ``m - w``
  rounds of one forward and one backward, then ``w`` cool-down backwards. Stage ``s``
  stashes at most ``min(p - s, m) <= p`` micro-batches, independent of ``m``.

Both have the same bubble: ``(p - 1) / (m + p - 1)`` of each stage's time when forward and
backward costs are equal across stages (``theoretical_bubble_fraction``). ``ScheduleKind``
is the one list of schedule names (configuration, the CLI and the wire fingerprint use it).

Executing an action is one switch, ``dispatch``: it hands each ``Action`` to an
``ActionExecutor`` (``recv``/``send`` with the message's direction and peer offset,
``forward``, ``backward``). The runtime's executor moves bytes and computes; ``simulate``'s
advances clocks and checks the schedule, by the same table.

Nothing here imports ``asyncio`` or ``socket``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from netdist.collectives.tags import RANGE_SIZE
from netdist.errors import ConfigError, PipelineError

__all__ = [
    "ScheduleKind",
    "ActionKind",
    "Action",
    "Direction",
    "ActionExecutor",
    "dispatch",
    "StageSchedule",
    "PipelineSchedule",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "build_schedule",
    "SimulationResult",
    "simulate",
    "theoretical_bubble_fraction",
    "message_tag",
    "PIPELINE_OWNER",
    "VALIDATE_OFFSET",
    "TAG_STEP_WINDOW",
]


T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class ScheduleKind(enum.StrEnum):
    """The pipeline schedules, by the name configuration and the CLI use."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"

    @classmethod
    def parse(cls, value: ScheduleKind | str) -> ScheduleKind:
        """A member, or its name in any case, with ``-`` and ``_`` ignored (``"1F-1B"``).

        ``TypeError`` for a non-string, ``ConfigError`` (a ``ValueError``) naming the
        choices for an unknown name.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(f"schedule must be a str, got {type(value).__name__}")
        normalised = value.strip().lower().replace("-", "").replace("_", "")
        for member in cls:
            if normalised == member.value:
                return member
        raise ConfigError(f"unknown pipeline schedule {value!r}; expected one of "
                          f"{tuple(m.value for m in cls)}")

    @property
    def wire_id(self) -> int:
        """The number neighbours compare in their configuration handshake."""
        return _WIRE_IDS[self]


_WIRE_IDS = {ScheduleKind.GPIPE: 1, ScheduleKind.ONE_F_ONE_B: 2}


class ActionKind(enum.Enum):
    """What one step of a stage's schedule does."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"


class Direction(enum.IntEnum):
    """Which way a pipeline message travels; part of its tag."""

    ACTIVATION = 0  # stage s -> s + 1
    GRAD = 1        # stage s + 1 -> s


@dataclass(frozen=True, slots=True)
class Action:
    """One step: ``kind`` for ``micro_batch``; ``peer`` is the other stage of a send/recv."""

    kind: ActionKind
    micro_batch: int
    peer: int | None = None

    def __str__(self) -> str:
        short = {
            ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B",
            ActionKind.SEND_ACTIVATION: "sA", ActionKind.RECV_ACTIVATION: "rA",
            ActionKind.SEND_GRAD: "sG", ActionKind.RECV_GRAD: "rG",
        }[self.kind]
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{short}{self.micro_batch}{peer}"


class ActionExecutor(Protocol[T_co]):
    """What runs a stage's actions: the runtime (coroutines) or ``simulate`` (whether the
    action ran or is blocked). ``offset`` is the peer stage minus this stage (-1 or +1)."""

    def recv(self, action: Action, direction: Direction, offset: int) -> T_co: ...

    def send(self, action: Action, direction: Direction, offset: int) -> T_co: ...

    def forward(self, action: Action) -> T_co: ...

    def backward(self, action: Action) -> T_co: ...


_DISPATCH: dict[ActionKind, Callable[[ActionExecutor[Any], Action], Any]] = {
    ActionKind.FORWARD: lambda run, a: run.forward(a),
    ActionKind.BACKWARD: lambda run, a: run.backward(a),
    ActionKind.RECV_ACTIVATION: lambda run, a: run.recv(a, Direction.ACTIVATION, -1),
    ActionKind.RECV_GRAD: lambda run, a: run.recv(a, Direction.GRAD, +1),
    ActionKind.SEND_ACTIVATION: lambda run, a: run.send(a, Direction.ACTIVATION, +1),
    ActionKind.SEND_GRAD: lambda run, a: run.send(a, Direction.GRAD, -1),
}


def dispatch(action: Action, executor: ActionExecutor[T]) -> T:
    """Hand ``action`` to the ``executor`` method for its kind: activations come from
    stage ``s - 1`` and go to ``s + 1``, gradients the other way."""
    return cast(T, _DISPATCH[action.kind](executor, action))


StageSchedule = tuple[Action, ...]
PipelineSchedule = tuple[StageSchedule, ...]
"""One ``StageSchedule`` per stage, stage 0 first."""


def _check(num_stages: int, num_micro_batches: int) -> None:
    for value, what in ((num_stages, "num_stages"), (num_micro_batches, "num_micro_batches")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")


def _forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    actions = []
    if stage > 0:
        actions.append(Action(ActionKind.RECV_ACTIVATION, mb, stage - 1))
    actions.append(Action(ActionKind.FORWARD, mb))
    if stage < num_stages - 1:
        actions.append(Action(ActionKind.SEND_ACTIVATION, mb, stage + 1))
    return actions


def _backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    actions = []
    if stage < num_stages - 1:
        actions.append(Action(ActionKind.RECV_GRAD, mb, stage + 1))
    actions.append(Action(ActionKind.BACKWARD, mb))
    if stage > 0:
        actions.append(Action(ActionKind.SEND_GRAD, mb, stage - 1))
    return actions


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """GPipe: every stage runs all ``m`` forwards, then all ``m`` backwards."""
    _check(num_stages, num_micro_batches)
    schedule = []
    for stage in range(num_stages):
        actions: list[Action] = []
        for mb in range(num_micro_batches):
            actions += _forward(stage, num_stages, mb)
        for mb in range(num_micro_batches):
            actions += _backward(stage, num_stages, mb)
        schedule.append(tuple(actions))
    return tuple(schedule)


def one_f_one_b_schedule(num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """1F1B: ``p - 1 - s`` warm-up forwards, steady one-forward-one-backward, cool-down."""
    _check(num_stages, num_micro_batches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_micro_batches)
        actions: list[Action] = []
        next_forward, next_backward = 0, 0
        for _ in range(warmup):
            actions += _forward(stage, num_stages, next_forward)
            next_forward += 1
        for _ in range(num_micro_batches - warmup):
            actions += _forward(stage, num_stages, next_forward)
            next_forward += 1
            actions += _backward(stage, num_stages, next_backward)
            next_backward += 1
        while next_backward < num_micro_batches:
            actions += _backward(stage, num_stages, next_backward)
            next_backward += 1
        schedule.append(tuple(actions))
    return tuple(schedule)


_BUILDERS = {ScheduleKind.GPIPE: gpipe_schedule, ScheduleKind.ONE_F_ONE_B: one_f_one_b_schedule}


def build_schedule(kind: ScheduleKind | str, num_stages: int, num_micro_batches: int
                   ) -> PipelineSchedule:
    """The schedule ``kind`` (a ``ScheduleKind`` or its name, ``"gpipe"`` / ``"1f1b"``)."""
    return _BUILDERS[ScheduleKind.parse(kind)](num_stages, num_micro_batches)


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What ``simulate`` observed while running every stage's schedule to completion.

    Times are in the units of the costs passed to ``simulate``.
    """

    makespan: float
    """Time at which the last stage finished."""
    busy: tuple[float, ...]
    """Per stage: time spent computing (forward + backward)."""
    finish: tuple[float, ...]
    """Per stage: time its last action ended."""
    peak_stashed: tuple[int, ...]
    """Per stage: most micro-batches whose activations were held at once."""
    messages: int
    """Sends executed (each matched by exactly one receive)."""

    @property
    def bubble_fractions(self) -> tuple[float, ...]:
        """Per stage: idle share of the makespan, ``1 - busy / makespan``."""
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(1.0 - b / self.makespan for b in self.busy)


def simulate(schedule: Sequence[Sequence[Action]], *, forward_cost: float = 1.0,
             backward_cost: float = 1.0, comm_cost: float = 0.0) -> SimulationResult:
    """Execute every stage's action list in one process with the runtime's semantics.

    Receives block until the matching send has run; sends never block. Raises
    ``PipelineError`` on a deadlock (naming what every stuck stage waits for), a receive
    or send naming the wrong peer, a message sent twice, a send never received, a
    backward before its forward, or a micro-batch not run exactly once each way.

    A discrete-event clock per stage gives the makespan and the bubble for the given
    costs: a message sent at time ``t`` can be received at ``t + comm_cost``.
    """
    if len(schedule) < 1:
        raise ValueError("schedule must have at least one stage")
    sim = _Simulation(schedule, forward_cost, backward_cost, comm_cost)
    sim.run()
    return sim.result()


_Message = tuple[int, int, Direction, int]
"""``(src, dst, direction, micro_batch)``."""

_SENT_BEFORE = {Direction.ACTIVATION: "activation sent before its forward",
                Direction.GRAD: "gradient sent before its backward"}


@dataclass(slots=True)
class _Simulation:
    """``simulate``'s state: the ``ActionExecutor`` whose methods say whether the action
    of stage ``stage`` ran (True) or is blocked on a message (False)."""

    schedule: Sequence[Sequence[Action]]
    forward_cost: float
    backward_cost: float
    comm_cost: float
    stage: int = 0
    messages: int = 0
    cursor: list[int] = field(default_factory=list)
    clock: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    stashed: list[set[int]] = field(default_factory=list)
    forwarded: list[set[int]] = field(default_factory=list)
    backwarded: list[set[int]] = field(default_factory=list)
    in_flight: dict[_Message, float] = field(default_factory=dict)   # -> arrival time
    delivered: set[_Message] = field(default_factory=set)

    def __post_init__(self) -> None:
        p = len(self.schedule)
        self.cursor, self.clock, self.busy, self.peak = [0] * p, [0.0] * p, [0.0] * p, [0] * p
        self.stashed = [set() for _ in range(p)]
        self.forwarded = [set() for _ in range(p)]
        self.backwarded = [set() for _ in range(p)]

    def run(self) -> None:
        """Advance every stage as far as it goes, round robin, until none can."""
        progressed = True
        while progressed:
            progressed = False
            for stage, actions in enumerate(self.schedule):
                self.stage = stage
                while self.cursor[stage] < len(actions):
                    if not dispatch(actions[self.cursor[stage]], self):
                        break  # blocked: try the other stages
                    self.cursor[stage] += 1
                    progressed = True

    def _fail(self, action: Action, why: str) -> PipelineError:
        return PipelineError(f"stage {self.stage}, action {self.cursor[self.stage]} "
                             f"({action}): {why}")

    def _neighbour(self, action: Action, offset: int) -> int:
        stage, peer = self.stage, action.peer
        if peer != stage + offset or not 0 <= peer < len(self.schedule):
            raise self._fail(action, f"peer must be stage {stage + offset}, got {peer}")
        return peer

    def recv(self, action: Action, direction: Direction, offset: int) -> bool:
        stage = self.stage
        key = (self._neighbour(action, offset), stage, direction, action.micro_batch)
        if key not in self.in_flight:
            if key in self.delivered:
                raise self._fail(action, "message already received once")
            return False
        self.clock[stage] = max(self.clock[stage], self.in_flight.pop(key))
        self.delivered.add(key)
        return True

    def send(self, action: Action, direction: Direction, offset: int) -> bool:
        stage, mb = self.stage, action.micro_batch
        done = self.forwarded if direction is Direction.ACTIVATION else self.backwarded
        if mb not in done[stage]:
            raise self._fail(action, _SENT_BEFORE[direction])
        key = (stage, self._neighbour(action, offset), direction, mb)
        if key in self.in_flight or key in self.delivered:
            raise self._fail(action, "message sent twice")
        self.in_flight[key] = self.clock[stage] + self.comm_cost
        self.messages += 1
        return True

    def forward(self, action: Action) -> bool:
        stage, mb = self.stage, action.micro_batch
        if mb in self.forwarded[stage]:
            raise self._fail(action, "forward run twice")
        if stage > 0 and (stage - 1, stage, Direction.ACTIVATION, mb) not in self.delivered:
            raise self._fail(action, "forward before its activation arrived")
        self.forwarded[stage].add(mb)
        self.stashed[stage].add(mb)
        self.peak[stage] = max(self.peak[stage], len(self.stashed[stage]))
        self.clock[stage] += self.forward_cost
        self.busy[stage] += self.forward_cost
        return True

    def backward(self, action: Action) -> bool:
        stage, mb = self.stage, action.micro_batch
        if mb not in self.stashed[stage]:
            raise self._fail(action, "backward without a stashed forward")
        last = len(self.schedule) - 1
        if stage < last and (stage + 1, stage, Direction.GRAD, mb) not in self.delivered:
            raise self._fail(action, "backward before its gradient arrived")
        self.stashed[stage].discard(mb)
        self.backwarded[stage].add(mb)
        self.clock[stage] += self.backward_cost
        self.busy[stage] += self.backward_cost
        return True

    def result(self) -> SimulationResult:
        """The figures, after checking that the run completed and matched every send."""
        schedule, cursor = self.schedule, self.cursor
        stuck = [s for s in range(len(schedule)) if cursor[s] < len(schedule[s])]
        if stuck:
            waits = ", ".join(f"stage {s} waits at action {cursor[s]} ({schedule[s][cursor[s]]})"
                              for s in stuck)
            raise PipelineError(f"pipeline schedule deadlocks: {waits}")
        if self.in_flight:
            unmatched = ", ".join(f"{d.name.lower()} {mb} from stage {src} to {dst}"
                                  for (src, dst, d, mb) in sorted(self.in_flight))
            raise PipelineError(f"sends never received: {unmatched}")
        micro_batches = set().union(*self.forwarded) | set().union(*self.backwarded)
        for stage in range(len(schedule)):
            forwarded, backwarded = self.forwarded[stage], self.backwarded[stage]
            if forwarded != micro_batches or backwarded != micro_batches:
                raise PipelineError(
                    f"stage {stage} ran forwards {sorted(forwarded)} and backwards "
                    f"{sorted(backwarded)}, expected each of {sorted(micro_batches)} once")
            if self.stashed[stage]:  # pragma: no cover - implied by the check above
                raise PipelineError(f"stage {stage} ends holding {sorted(self.stashed[stage])}")
        return SimulationResult(
            makespan=max(self.clock) if self.clock else 0.0,
            busy=tuple(self.busy),
            finish=tuple(self.clock),
            peak_stashed=tuple(self.peak),
            messages=self.messages,
        )


def theoretical_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of each stage for GPipe and 1F1B: ``(p - 1) / (m + p - 1)``."""
    _check(num_stages, num_micro_batches)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


PIPELINE_OWNER = "pipeline"
"""Owner name of the tag ranges pipelines reserve (``Group.reserve_tags``)."""

TAG_STEP_WINDOW = 1 << 12
"""Steps before message tags repeat; a step never overlaps one 4096 steps earlier."""

VALIDATE_OFFSET = RANGE_SIZE - 1
"""Offset in the pipeline's tag range of the one-time configuration check; messages
use the offsets below it."""


def message_tag(step: int, micro_batch: int, direction: Direction,
                num_micro_batches: int) -> int:
    """Offset of one pipeline message in the pipeline's tag range: distinct per step,
    micro-batch and direction.

    ``((step % TAG_STEP_WINDOW) * m + micro_batch) * 2 + direction``; stays below
    ``VALIDATE_OFFSET``. ``ValueError`` if ``num_micro_batches`` is too large for the window.
    """
    if not 0 <= micro_batch < num_micro_batches:
        raise ValueError(f"micro_batch {micro_batch} is outside 0..{num_micro_batches - 1}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if TAG_STEP_WINDOW * num_micro_batches * 2 > VALIDATE_OFFSET:
        raise ValueError(
            f"num_micro_batches={num_micro_batches} is too large for the pipeline's tag "
            f"range (at most {VALIDATE_OFFSET // (2 * TAG_STEP_WINDOW)})")
    return ((step % TAG_STEP_WINDOW) * num_micro_batches + micro_batch) * 2 + int(direction)
