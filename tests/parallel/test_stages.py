"""Stage splitting, cost balancing and the pipeline configuration (all pure)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netdist.errors import PipelineError
from netdist.parallel.stages import (
    PipelineParallelConfig,
    PipelineStage,
    balance_stages,
    micro_batch_bounds,
    parameter_costs,
    split_into_stages,
    stage_costs,
)


def covers_contiguously(stages: list[PipelineStage], num_layers: int) -> bool:
    return (stages[0].start_layer == 0 and stages[-1].end_layer == num_layers
            and all(a.end_layer == b.start_layer for a, b in zip(stages, stages[1:]))
            and [s.rank for s in stages] == list(range(len(stages))))


# -- split_into_stages --------------------------------------------------------------------

def test_split_ten_layers_into_three_stages_covers_all_layers_contiguously() -> None:
    stages = split_into_stages(10, 3)
    assert stages == [PipelineStage(0, 4, 0), PipelineStage(4, 7, 1), PipelineStage(7, 10, 2)]
    covered = [layer for stage in stages for layer in stage.layers]
    assert covered == list(range(10))
    assert [s.num_layers for s in stages] == [4, 3, 3]


def test_split_even_and_single() -> None:
    assert split_into_stages(8, 4) == [PipelineStage(2 * i, 2 * i + 2, i) for i in range(4)]
    assert split_into_stages(5, 1) == [PipelineStage(0, 5, 0)]
    assert split_into_stages(3, 3) == [PipelineStage(i, i + 1, i) for i in range(3)]


@pytest.mark.parametrize(("layers", "stages"), [(5, 0), (3, 4), (0, 1)])
def test_split_refuses_zero_stages_or_more_stages_than_layers(layers: int, stages: int) -> None:
    with pytest.raises(ValueError, match="stage"):
        split_into_stages(layers, stages)


def test_split_type_errors() -> None:
    with pytest.raises(TypeError):
        split_into_stages(10.0, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        split_into_stages(10, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        split_into_stages(-1, 1)


@given(num_layers=st.integers(1, 200), data=st.data())
@settings(max_examples=200, deadline=None)
def test_split_properties(num_layers: int, data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(1, num_layers))
    stages = split_into_stages(num_layers, num_stages)
    assert len(stages) == num_stages
    assert covers_contiguously(stages, num_layers)
    sizes = [s.num_layers for s in stages]
    extra = num_layers % num_stages
    base = num_layers // num_stages
    assert sizes == [base + 1] * extra + [base] * (num_stages - extra)
    assert max(sizes) - min(sizes) <= 1


# -- PipelineStage ------------------------------------------------------------------------

def test_stage_end_is_exclusive_and_select_slices() -> None:
    stage = PipelineStage(2, 5, 1)
    assert stage.num_layers == 3
    assert list(stage.layers) == [2, 3, 4]
    assert stage.select(list("abcdefg")) == ["c", "d", "e"]
    with pytest.raises(ValueError, match="needs layers up to 5"):
        stage.select(list("abcd"))


def test_stage_is_frozen_and_validated() -> None:
    stage = PipelineStage(0, 1, 0)
    with pytest.raises(AttributeError):
        stage.rank = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="exclusive"):
        PipelineStage(3, 3, 0)
    with pytest.raises(ValueError, match="exclusive"):
        PipelineStage(4, 2, 0)
    with pytest.raises(ValueError, match="start_layer"):
        PipelineStage(-1, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        PipelineStage(0, 2, -1)
    with pytest.raises(TypeError):
        PipelineStage(0, 2.0, 0)  # type: ignore[arg-type]


# -- balance_stages -----------------------------------------------------------------------

def brute_force_bottleneck(costs: list, num_stages: int) -> Fraction:
    """Smallest achievable largest-stage cost, trying every set of cut points."""
    exact = [Fraction(c) for c in costs]
    n = len(exact)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(exact[a:b], Fraction(0)) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None or worst < best else best
    assert best is not None
    return best


def achieved_bottleneck(costs: list, stages: list[PipelineStage]) -> Fraction:
    exact = [Fraction(c) for c in costs]
    return max(sum(exact[s.start_layer:s.end_layer], Fraction(0)) for s in stages)


@given(costs=st.lists(st.integers(0, 50), min_size=1, max_size=9), data=st.data())
@settings(max_examples=300, deadline=None)
def test_balance_matches_brute_force_on_integer_costs(costs: list[int],
                                                      data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(1, len(costs)))
    stages = balance_stages(costs, num_stages)
    assert len(stages) == num_stages
    assert covers_contiguously(stages, len(costs))
    assert achieved_bottleneck(costs, stages) == brute_force_bottleneck(costs, num_stages)


@given(costs=st.lists(st.floats(0, 1e3, allow_nan=False, allow_infinity=False),
                      min_size=1, max_size=8), data=st.data())
@settings(max_examples=200, deadline=None)
def test_balance_matches_brute_force_on_float_costs(costs: list[float],
                                                    data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(1, len(costs)))
    stages = balance_stages(costs, num_stages)
    assert covers_contiguously(stages, len(costs))
    # exact rational arithmetic on both sides: the optimum is exact, not approximate
    assert achieved_bottleneck(costs, stages) == brute_force_bottleneck(costs, num_stages)


def test_balance_known_cases() -> None:
    assert balance_stages([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [
        PipelineStage(0, 5, 0), PipelineStage(5, 7, 1), PipelineStage(7, 9, 2)]
    # one heavy layer gets a stage to itself
    assert balance_stages([1, 1, 10, 1, 1], 3) == [
        PipelineStage(0, 2, 0), PipelineStage(2, 3, 1), PipelineStage(3, 5, 2)]
    # all-zero costs still give every stage a layer
    assert balance_stages([0, 0, 0, 0], 4) == [PipelineStage(i, i + 1, i) for i in range(4)]
    assert balance_stages(np.array([3.5, 0.25, 0.25, 3.5]), 2) == [
        PipelineStage(0, 2, 0), PipelineStage(2, 4, 1)]
    assert stage_costs([1, 2, 3, 4], [PipelineStage(0, 3, 0), PipelineStage(3, 4, 1)]) == [
        6.0, 4.0]


def test_balance_validation() -> None:
    with pytest.raises(ValueError, match="stage"):
        balance_stages([1, 2], 0)
    with pytest.raises(ValueError, match="every stage needs"):
        balance_stages([1, 2], 3)
    with pytest.raises(ValueError, match="negative"):
        balance_stages([1, -2], 1)
    with pytest.raises(ValueError, match="not finite"):
        balance_stages([1, float("nan")], 1)
    with pytest.raises(ValueError, match="not finite"):
        balance_stages([float("inf"), 1.0], 2)
    with pytest.raises(TypeError):
        balance_stages(["a", 1], 1)
    with pytest.raises(TypeError):
        balance_stages([True, 1], 1)


def test_parameter_costs_from_the_training_kit() -> None:
    from netdist.train.nn import mlp

    model = mlp([8, 32, 16, 4], rng=np.random.default_rng(0))
    costs = parameter_costs(model.layers)
    assert costs == [8 * 32 + 32, 0, 32 * 16 + 16, 0, 16 * 4 + 4]
    stages = balance_stages(costs, 2)
    assert stages == [PipelineStage(0, 2, 0), PipelineStage(2, 5, 1)]


# -- PipelineParallelConfig and micro-batches ---------------------------------------------

def test_config_defaults_layout_and_normalisation() -> None:
    config = PipelineParallelConfig(num_stages=3, num_micro_batches=4)
    assert config.schedule == "gpipe"
    assert config.data_parallel_size == 1
    assert config.world_size == 3
    assert PipelineParallelConfig(2, 4, schedule="1F1B").schedule == "1f1b"
    assert PipelineParallelConfig(2, 4, schedule="1f-1b").schedule == "1f1b"
    two_d = PipelineParallelConfig(3, 4, "1f1b", data_parallel_size=2)
    assert two_d.world_size == 6
    assert [two_d.stage_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [two_d.replica_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert two_d.rank_of(2, 1) == 5
    assert two_d.pipeline_ranks(1) == (3, 4, 5)
    assert two_d.data_parallel_ranks(1) == (1, 4)
    with pytest.raises(ValueError):
        two_d.rank_of(3, 0)
    with pytest.raises(ValueError):
        two_d.stage_of(6)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        PipelineParallelConfig(0, 4)
    with pytest.raises(ValueError, match="num_micro_batches"):
        PipelineParallelConfig(2, 0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        PipelineParallelConfig(2, 2, data_parallel_size=0)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'"):
        PipelineParallelConfig(2, 2, schedule="interleaved")
    with pytest.raises(TypeError):
        PipelineParallelConfig(2, 2, schedule=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PipelineParallelConfig(2.0, 2)  # type: ignore[arg-type]
    config = PipelineParallelConfig(2, 2, data_parallel_size=2)
    config.check_world_size(4)
    with pytest.raises(PipelineError, match=r"2 \* 2 = 4 ranks, got world size 3"):
        config.check_world_size(3)


def test_micro_batch_bounds_even_uneven_and_refused() -> None:
    assert micro_batch_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert micro_batch_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert micro_batch_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(PipelineError, match="3 rows cannot be split into 4"):
        micro_batch_bounds(3, 4)
