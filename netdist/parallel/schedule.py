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
backward costs are equal across stages (``theoretical_bubble_fraction``).

Nothing here imports ``asyncio`` or ``socket``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from netdist.errors import PipelineError

__all__ = [
    "ActionKind",
    "Action",
    "Direction",
    "StageSchedule",
    "PipelineSchedule",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "build_schedule",
    "SimulationResult",
    "simulate",
    "theoretical_bubble_fraction",
    "message_tag",
    "TAG_BASE",
    "TAG_STEP_WINDOW",
]


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


_BUILDERS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def build_schedule(kind: str, num_stages: int, num_micro_batches: int) -> PipelineSchedule:
    """The schedule named ``kind`` (``"gpipe"`` or ``"1f1b"``)."""
    try:
        builder = _BUILDERS[kind]
    except KeyError:
        raise ValueError(
            f"unknown pipeline schedule {kind!r}; expected one of {tuple(_BUILDERS)}"
        ) from None
    return builder(num_stages, num_micro_batches)


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
    p = len(schedule)
    if p < 1:
        raise ValueError("schedule must have at least one stage")
    cursor = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    stashed: list[set[int]] = [set() for _ in range(p)]
    peak = [0] * p
    forwarded: list[set[int]] = [set() for _ in range(p)]
    backwarded: list[set[int]] = [set() for _ in range(p)]
    # in flight: (src, dst, direction, micro_batch) -> arrival time
    in_flight: dict[tuple[int, int, Direction, int], float] = {}
    delivered: set[tuple[int, int, Direction, int]] = set()
    messages = 0

    def fail(stage: int, action: Action, why: str) -> PipelineError:
        return PipelineError(f"stage {stage}, action {cursor[stage]} ({action}): {why}")

    def expect_neighbour(stage: int, action: Action, offset: int) -> int:
        peer = action.peer
        if peer != stage + offset or not 0 <= peer < p:
            raise fail(stage, action, f"peer must be stage {stage + offset}, got {peer}")
        return peer

    progressed = True
    while progressed:
        progressed = False
        for stage in range(p):
            actions = schedule[stage]
            while cursor[stage] < len(actions):
                action = actions[cursor[stage]]
                mb = action.micro_batch
                kind = action.kind
                if kind in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRAD):
                    if kind is ActionKind.RECV_ACTIVATION:
                        key = (expect_neighbour(stage, action, -1), stage,
                               Direction.ACTIVATION, mb)
                    else:
                        key = (expect_neighbour(stage, action, +1), stage, Direction.GRAD, mb)
                    if key not in in_flight:
                        if key in delivered:
                            raise fail(stage, action, "message already received once")
                        break  # blocked: try the other stages
                    clock[stage] = max(clock[stage], in_flight.pop(key))
                    delivered.add(key)
                elif kind in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRAD):
                    if kind is ActionKind.SEND_ACTIVATION:
                        if mb not in forwarded[stage]:
                            raise fail(stage, action, "activation sent before its forward")
                        key = (stage, expect_neighbour(stage, action, +1),
                               Direction.ACTIVATION, mb)
                    else:
                        if mb not in backwarded[stage]:
                            raise fail(stage, action, "gradient sent before its backward")
                        key = (stage, expect_neighbour(stage, action, -1), Direction.GRAD, mb)
                    if key in in_flight or key in delivered:
                        raise fail(stage, action, "message sent twice")
                    in_flight[key] = clock[stage] + comm_cost
                    messages += 1
                elif kind is ActionKind.FORWARD:
                    if mb in forwarded[stage]:
                        raise fail(stage, action, "forward run twice")
                    if stage > 0 and (stage - 1, stage, Direction.ACTIVATION, mb) not in delivered:
                        raise fail(stage, action, "forward before its activation arrived")
                    forwarded[stage].add(mb)
                    stashed[stage].add(mb)
                    peak[stage] = max(peak[stage], len(stashed[stage]))
                    clock[stage] += forward_cost
                    busy[stage] += forward_cost
                elif kind is ActionKind.BACKWARD:
                    if mb not in stashed[stage]:
                        raise fail(stage, action, "backward without a stashed forward")
                    if stage < p - 1 and (stage + 1, stage, Direction.GRAD, mb) not in delivered:
                        raise fail(stage, action, "backward before its gradient arrived")
                    stashed[stage].discard(mb)
                    backwarded[stage].add(mb)
                    clock[stage] += backward_cost
                    busy[stage] += backward_cost
                else:  # pragma: no cover - enum is closed
                    raise fail(stage, action, f"unknown action kind {kind}")
                cursor[stage] += 1
                progressed = True

    stuck = [s for s in range(p) if cursor[s] < len(schedule[s])]
    if stuck:
        waits = ", ".join(f"stage {s} waits at action {cursor[s]} ({schedule[s][cursor[s]]})"
                          for s in stuck)
        raise PipelineError(f"pipeline schedule deadlocks: {waits}")
    if in_flight:
        unmatched = ", ".join(f"{d.name.lower()} {mb} from stage {src} to {dst}"
                              for (src, dst, d, mb) in sorted(in_flight))
        raise PipelineError(f"sends never received: {unmatched}")
    micro_batches = set().union(*forwarded) | set().union(*backwarded)
    for stage in range(p):
        if forwarded[stage] != micro_batches or backwarded[stage] != micro_batches:
            raise PipelineError(
                f"stage {stage} ran forwards {sorted(forwarded[stage])} and backwards "
                f"{sorted(backwarded[stage])}, expected each of {sorted(micro_batches)} once")
        if stashed[stage]:  # pragma: no cover - implied by the check above
            raise PipelineError(f"stage {stage} ends holding {sorted(stashed[stage])}")
    return SimulationResult(
        makespan=max(clock) if clock else 0.0,
        busy=tuple(busy),
        finish=tuple(clock),
        peak_stashed=tuple(peak),
        messages=messages,
    )


def theoretical_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of each stage for GPipe and 1F1B: ``(p - 1) / (m + p - 1)``."""
    _check(num_stages, num_micro_batches)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


TAG_BASE = 0x4E50_0000
"""First transport tag the pipeline runtime uses (``b"NP"`` in the high bytes)."""

TAG_STEP_WINDOW = 1 << 12
"""Steps before message tags repeat; a step never overlaps one 4096 steps earlier."""

_APP_TAG_LIMIT = 1 << 32  # application tags stay below 2**32 (groups allocate above)


def message_tag(step: int, micro_batch: int, direction: Direction,
                num_micro_batches: int, *, base: int = TAG_BASE) -> int:
    """Transport tag of one pipeline message: distinct per step, micro-batch, direction.

    ``base + ((step % TAG_STEP_WINDOW) * m + micro_batch) * 2 + direction``; stays below
    ``2**32`` (the application range; collectives allocate above it). ``ValueError`` if
    ``num_micro_batches`` is too large for the window.
    """
    if not 0 <= micro_batch < num_micro_batches:
        raise ValueError(f"micro_batch {micro_batch} is outside 0..{num_micro_batches - 1}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    space = _APP_TAG_LIMIT - base
    if TAG_STEP_WINDOW * num_micro_batches * 2 > space:
        raise ValueError(
            f"num_micro_batches={num_micro_batches} is too large for the pipeline tag space "
            f"above {base} (at most {max(space, 0) // (2 * TAG_STEP_WINDOW)})")
    offset = ((step % TAG_STEP_WINDOW) * num_micro_batches + micro_batch) * 2 + int(direction)
    return base + offset
