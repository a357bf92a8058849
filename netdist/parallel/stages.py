"""PURE stage arithmetic for pipeline parallelism: which layers live on which rank.

A model of ``L`` layers is cut into ``p`` contiguous stages. ``PipelineStage`` is the plain
record of one cut, ``split_into_stages`` cuts by layer count and ``balance_stages`` cuts
by cost (parameter counts or measured per-layer times) so that the slowest stage, which
sets the pace of the whole pipeline, is as fast as possible.

``PipelineParallelConfig`` also fixes the rank layout of 2-D (pipeline x data) parallelism
used by ``netdist.parallel.pipeline``::

    rank = replica * num_stages + stage          stage = rank % num_stages
                                                 replica = rank // num_stages

so the ``num_stages`` ranks of one pipeline replica are consecutive, and the ranks holding
stage ``s`` in every replica (``s, s + p, s + 2p, ...``) form that stage's data-parallel
group, whose gradients are averaged after every mini-batch.

Micro-batching: a mini-batch of ``B`` rows is split into ``m`` micro-batches by the rule
used everywhere in netdist (``netdist.sharding.chunk_bounds``): the first ``B % m``
micro-batches are one row longer. Uneven micro-batches are allowed; each micro-batch's loss
is weighted by ``rows / B`` so the accumulated gradient equals the full mini-batch mean
(``1 / m`` when ``m`` divides ``B``). ``B < m`` (an empty micro-batch) is refused.

Nothing here imports ``asyncio`` or ``socket``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from netdist.errors import PipelineError
from netdist.parallel.schedule import ScheduleKind
from netdist.sharding import chunk_bounds

__all__ = [
    "PipelineStage",
    "PipelineParallelConfig",
    "SCHEDULES",
    "split_into_stages",
    "balance_stages",
    "stage_costs",
    "parameter_costs",
    "micro_batch_bounds",
]

SCHEDULES: tuple[str, ...] = tuple(kind.value for kind in ScheduleKind)
"""Names accepted by ``PipelineParallelConfig.schedule`` (``ScheduleKind``'s values)."""


def _check_int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Layers ``[start_layer, end_layer)`` of the model, held by pipeline stage ``rank``.

    ``end_layer`` is exclusive, as in ``range`` and slicing: the stage holds
    ``layers[start_layer:end_layer]``. ``rank`` is the stage index within one pipeline
    (0 = first stage); with data parallelism the global rank of stage ``s`` in replica
    ``r`` is ``PipelineParallelConfig.rank_of(s, r)``. A stage holds at least one layer.
    """

    start_layer: int
    end_layer: int
    rank: int

    def __post_init__(self) -> None:
        _check_int(self.start_layer, "start_layer", 0)
        _check_int(self.end_layer, "end_layer", 0)
        _check_int(self.rank, "rank", 0)
        if self.end_layer <= self.start_layer:
            raise ValueError(
                f"stage {self.rank}: end_layer ({self.end_layer}) must be greater than "
                f"start_layer ({self.start_layer}); end_layer is exclusive")

    @property
    def num_layers(self) -> int:
        """How many layers this stage holds."""
        return self.end_layer - self.start_layer

    @property
    def layers(self) -> range:
        """The indices of this stage's layers."""
        return range(self.start_layer, self.end_layer)

    def select(self, layers: Sequence[Any]) -> list[Any]:
        """This stage's slice of the full model's layer list."""
        if self.end_layer > len(layers):
            raise ValueError(
                f"stage {self.rank} needs layers up to {self.end_layer} but the model has "
                f"{len(layers)}")
        return list(layers[self.start_layer:self.end_layer])


@dataclass(frozen=True, slots=True)
class PipelineParallelConfig:
    """How one mini-batch is pipelined: stages, micro-batches, schedule, replicas.

    - ``num_stages`` (p): ranks per pipeline replica, one stage each.
    - ``num_micro_batches`` (m): micro-batches per mini-batch; more shrinks the bubble,
      ``(p - 1) / (m + p - 1)`` of each stage's time.
    - ``schedule``: a ``ScheduleKind`` or its name: ``"gpipe"`` (all forwards, then all
      backwards; every stage stashes ``m`` micro-batches' activations) or ``"1f1b"``
      (warm-up, one forward one backward, cool-down; at most ``p - stage`` stashed).
      Stored as the ``ScheduleKind`` (a ``str``: ``config.schedule == "1f1b"``).
    - ``data_parallel_size``: replicas of the pipeline; world size is ``p * replicas``.
    """

    num_stages: int
    num_micro_batches: int
    schedule: ScheduleKind | str = ScheduleKind.GPIPE
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_int(self.num_stages, "num_stages", 1)
        _check_int(self.num_micro_batches, "num_micro_batches", 1)
        _check_int(self.data_parallel_size, "data_parallel_size", 1)
        object.__setattr__(self, "schedule", ScheduleKind.parse(self.schedule))

    @property
    def schedule_kind(self) -> ScheduleKind:
        """``schedule``, typed (it always holds a ``ScheduleKind`` once built)."""
        return ScheduleKind.parse(self.schedule)

    @property
    def world_size(self) -> int:
        """Ranks needed: ``num_stages * data_parallel_size``."""
        return self.num_stages * self.data_parallel_size

    def stage_of(self, rank: int) -> int:
        """Pipeline stage held by global ``rank``."""
        return self._check_rank(rank) % self.num_stages

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica that global ``rank`` belongs to."""
        return self._check_rank(rank) // self.num_stages

    def rank_of(self, stage: int, replica: int = 0) -> int:
        """Global rank of ``stage`` in ``replica``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        if not 0 <= replica < self.data_parallel_size:
            raise ValueError(f"replica {replica} is outside 0..{self.data_parallel_size - 1}")
        return replica * self.num_stages + stage

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """Global ranks of one replica's stages, first stage first."""
        return tuple(self.rank_of(s, replica) for s in range(self.num_stages))

    def data_parallel_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks holding ``stage`` in every replica (its gradient all-reduce group)."""
        return tuple(self.rank_of(stage, r) for r in range(self.data_parallel_size))

    def check_world_size(self, world_size: int) -> None:
        """Raise ``PipelineError`` unless ``world_size`` is exactly ``num_stages * replicas``."""
        if world_size != self.world_size:
            raise PipelineError(
                f"pipeline needs num_stages * data_parallel_size = {self.num_stages} * "
                f"{self.data_parallel_size} = {self.world_size} ranks, got world size "
                f"{world_size}")

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return int(rank)


def split_into_stages(num_layers: int, num_stages: int) -> list[PipelineStage]:
    """Cut ``num_layers`` layers into ``num_stages`` contiguous, near-equal stages.

    The first ``num_layers % num_stages`` stages hold one extra layer. ``ValueError`` for
    fewer than one stage or more stages than layers (a stage must hold a layer).
    """
    num_layers = _check_int(num_layers, "num_layers", 0)
    num_stages = _check_int(num_stages, "num_stages", 0)
    if num_stages == 0:
        raise ValueError("num_stages must be >= 1, got 0")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs "
            f"at least one layer")
    return [PipelineStage(start, stop, rank)
            for rank, (start, stop) in enumerate(chunk_bounds(num_layers, num_stages))]


def _exact_integer_costs(costs: Iterable[Any]) -> list[int]:
    """Scale non-negative finite costs to integers exactly (floats are dyadic rationals)."""
    values = list(costs)
    fractions: list[Fraction] = []
    for index, cost in enumerate(values):
        if isinstance(cost, bool):
            raise TypeError(f"cost {index} is a bool, expected a number")
        if isinstance(cost, (int, np.integer)):
            frac = Fraction(int(cost))
        elif isinstance(cost, (float, np.floating)):
            if not math.isfinite(float(cost)):
                raise ValueError(f"cost {index} is not finite: {cost!r}")
            frac = Fraction(float(cost))
        elif isinstance(cost, Fraction):
            frac = cost
        else:
            raise TypeError(f"cost {index} must be a number, got {type(cost).__name__}")
        if frac < 0:
            raise ValueError(f"cost {index} is negative: {cost!r}")
        fractions.append(frac)
    scale = math.lcm(*(f.denominator for f in fractions)) if fractions else 1
    return [int(f * scale) for f in fractions]


def _fits(costs: Sequence[int], limit: int) -> int:
    """Fewest contiguous groups with sums <= ``limit`` (greedy is optimal for >= 0 costs)."""
    groups, current = 1, 0
    for cost in costs:
        if current + cost > limit:
            groups += 1
            current = cost
        else:
            current += cost
    return groups


def balance_stages(costs: Sequence[Any], num_stages: int) -> list[PipelineStage]:
    """Contiguous stages minimising the largest stage cost (exact).

    ``costs[i]`` is layer ``i``'s cost: its parameter count (``parameter_costs``),
    measured forward+backward seconds, FLOPs, ... Any non-negative finite numbers; floats
    are converted to integers exactly (a float is a dyadic rational), so the optimum is
    exact, not approximate. The optimal bottleneck is found by binary search over the
    answer with a greedy feasibility test; the stages returned are the greedy cut at that
    bottleneck (earlier stages as full as the bound allows), each holding >= 1 layer.
    ``ValueError`` for fewer than one stage or more stages than layers.
    """
    num_stages = _check_int(num_stages, "num_stages", 0)
    if num_stages == 0:
        raise ValueError("num_stages must be >= 1, got 0")
    weights = _exact_integer_costs(costs)
    n = len(weights)
    if num_stages > n:
        raise ValueError(
            f"cannot balance {n} layers into {num_stages} stages: every stage needs at "
            f"least one layer")
    low, high = max(weights), sum(weights)
    while low < high:
        middle = (low + high) // 2
        if _fits(weights, middle) <= num_stages:
            high = middle
        else:
            low = middle + 1
    bottleneck = low
    # Greedy cut at the optimal bottleneck, closing a stage early only when the layers
    # left are exactly enough to give every remaining stage one layer each.
    stages: list[PipelineStage] = []
    start, current = 0, 0
    for index, weight in enumerate(weights):
        remaining_stages = num_stages - len(stages) - 1  # after the open one
        if index > start and (current + weight > bottleneck
                              or n - index == remaining_stages):
            stages.append(PipelineStage(start, index, len(stages)))
            start, current = index, 0
        current += weight
    stages.append(PipelineStage(start, n, len(stages)))
    if len(stages) != num_stages:  # pragma: no cover - guarded by the feasibility search
        raise PipelineError(f"balance_stages: internal error: cut {len(stages)} stages for "
                            f"num_stages={num_stages}")
    return stages


def stage_costs(costs: Sequence[float], stages: Sequence[PipelineStage]) -> list[float]:
    """Total cost of each stage (for reporting the balance achieved)."""
    return [float(sum(costs[stage.start_layer:stage.end_layer])) for stage in stages]


def parameter_costs(layers: Sequence[Any]) -> list[int]:
    """Per-layer parameter counts, a cost model for ``balance_stages``.

    ``layers`` are modules with ``parameters()`` returning objects with a ``data`` array
    (the ``netdist.train`` Module API); parameter-free layers (activations) cost 0.
    """
    return [sum(int(np.asarray(p.data).size) for p in layer.parameters()) for layer in layers]


def micro_batch_bounds(batch_size: int, num_micro_batches: int) -> list[tuple[int, int]]:
    """``(start, stop)`` rows of each micro-batch; the first ``B % m`` are one row longer.

    ``PipelineError`` when the batch has fewer rows than micro-batches (a micro-batch
    would be empty).
    """
    batch_size = _check_int(batch_size, "batch_size", 0)
    num_micro_batches = _check_int(num_micro_batches, "num_micro_batches", 1)
    if batch_size < num_micro_batches:
        raise PipelineError(
            f"a batch of {batch_size} rows cannot be split into {num_micro_batches} "
            f"non-empty micro-batches")
    return chunk_bounds(batch_size, num_micro_batches)
