"""GPipe and 1F1B schedules, checked by simulating every stage in one process."""

from __future__ import annotations

import pytest

from netdist.errors import PipelineError
from netdist.parallel.schedule import (
    VALIDATE_OFFSET,
    TAG_STEP_WINDOW,
    Action,
    ActionKind,
    Direction,
    build_schedule,
    gpipe_schedule,
    message_tag,
    one_f_one_b_schedule,
    simulate,
    theoretical_bubble_fraction,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SA, RA = ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION
SG, RG = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD

STAGES = range(2, 5)
MICRO_BATCHES = range(1, 9)


def compute_order(actions: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in actions if a.kind in (F, B)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_schedule_simulates_without_deadlock_and_matches_every_send(kind: str, p: int,
                                                                    m: int) -> None:
    schedule = build_schedule(kind, p, m)
    assert len(schedule) == p
    result = simulate(schedule)  # raises on deadlock / unmatched send / double receive
    # one activation and one gradient per micro-batch per stage boundary
    assert result.messages == 2 * m * (p - 1)
    for stage, actions in enumerate(schedule):
        sends = [(a.kind.value, a.micro_batch) for a in actions if a.kind in (SA, SG)]
        assert sorted(sends) == sorted(
            [(SA.value, i) for i in range(m) if stage < p - 1]
            + [(SG.value, i) for i in range(m) if stage > 0])
        assert sorted(a.micro_batch for a in actions if a.kind is F) == list(range(m))
        assert sorted(a.micro_batch for a in actions if a.kind is B) == list(range(m))
    # every send is matched by exactly one receive on the neighbour
    for stage in range(p - 1):
        sent = [a.micro_batch for a in schedule[stage] if a.kind is SA]
        got = [a.micro_batch for a in schedule[stage + 1] if a.kind is RA]
        assert sorted(sent) == sorted(got) == list(range(m))
        sent_g = [a.micro_batch for a in schedule[stage + 1] if a.kind is SG]
        got_g = [a.micro_batch for a in schedule[stage] if a.kind is RG]
        assert sorted(sent_g) == sorted(got_g) == list(range(m))


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m(p: int, m: int) -> None:
    one_f = simulate(one_f_one_b_schedule(p, m))
    gpipe = simulate(gpipe_schedule(p, m))
    assert one_f.peak_stashed == tuple(min(p - s, m) for s in range(p))
    assert max(one_f.peak_stashed) <= p
    assert gpipe.peak_stashed == tuple([m] * p)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_simulated_bubble_equals_theory_for_equal_costs(kind: str, p: int, m: int) -> None:
    result = simulate(build_schedule(kind, p, m), forward_cost=1.0, backward_cost=1.0)
    assert result.makespan == 2 * (m + p - 1)
    theory = theoretical_bubble_fraction(p, m)
    for bubble in result.bubble_fractions:
        assert bubble == pytest.approx(theory, abs=1e-15)


def test_exact_action_lists() -> None:
    gpipe = gpipe_schedule(2, 2)
    assert [str(a) for a in gpipe[0]] == ["F0", "sA0@1", "F1", "sA1@1", "rG0@1", "B0",
                                          "rG1@1", "B1"]
    assert [str(a) for a in gpipe[1]] == ["rA0@0", "F0", "rA1@0", "F1", "B0", "sG0@0",
                                          "B1", "sG1@0"]
    one_f = one_f_one_b_schedule(3, 4)
    assert compute_order(one_f[0]) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert compute_order(one_f[1]) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert compute_order(one_f[2]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # fewer micro-batches than the warm-up depth: warm-up is cut to m
    assert compute_order(one_f_one_b_schedule(4, 1)[0]) == ["F0", "B0"]
    # one stage: no communication at all
    assert [str(a) for a in gpipe_schedule(1, 2)[0]] == ["F0", "F1", "B0", "B1"]


def test_simulator_detects_deadlock() -> None:
    # both stages receive before sending: a classic deadlock
    bad = (
        (Action(RG, 0, 1), Action(F, 0), Action(SA, 0, 1), Action(B, 0)),
        (Action(RA, 0, 0), Action(F, 0), Action(B, 0), Action(SG, 0, 0)),
    )
    with pytest.raises(PipelineError, match="deadlocks: stage 0 waits at action 0 "
                                            r"\(rG0@1\), stage 1 waits at action 0"):
        simulate(bad)


def test_simulator_detects_unmatched_and_misordered_actions() -> None:
    schedule = list(gpipe_schedule(2, 1))
    # stage 1 forgets its gradient send: stage 0 blocks for ever
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate((schedule[0], schedule[1][:-1]))
    # an extra send nobody receives
    with pytest.raises(PipelineError, match="sends never received: activation 1 from stage 0"):
        simulate((schedule[0][:2] + (Action(F, 1), Action(SA, 1, 1)) + schedule[0][2:],
                  schedule[1]))
    with pytest.raises(PipelineError, match="backward without a stashed forward"):
        simulate(((Action(B, 0), Action(F, 0)),))
    with pytest.raises(PipelineError, match="peer must be stage 1"):
        simulate(((Action(F, 0), Action(SA, 0, 0)), (Action(RA, 0, 0),)))
    with pytest.raises(PipelineError, match="activation sent before its forward"):
        simulate(((Action(SA, 0, 1),), (Action(RA, 0, 0),)))
    with pytest.raises(PipelineError, match="forward run twice"):
        simulate(((Action(F, 0), Action(F, 0), Action(B, 0)),))
    with pytest.raises(PipelineError, match="backward before its gradient arrived"):
        simulate(((Action(F, 0), Action(B, 0)), (Action(F, 1), Action(B, 1))))
    # stage 0 runs a forward it never runs backward
    with pytest.raises(PipelineError, match=r"stage 0 ran forwards \[0, 1\] and backwards "
                                            r"\[0\], expected each of \[0, 1\] once"):
        simulate(((Action(F, 0), Action(SA, 0, 1), Action(F, 1), Action(RG, 0, 1),
                   Action(B, 0)),
                  (Action(RA, 0, 0), Action(F, 0), Action(B, 0), Action(SG, 0, 0))))


def test_simulator_timing_with_unequal_costs() -> None:
    # backward twice as expensive: same busy time, GPipe makespan m(f+b) + (p-1)(f+b+2c)
    p, m = 3, 4
    a = simulate(gpipe_schedule(p, m), forward_cost=1, backward_cost=2, comm_cost=0.5)
    b = simulate(one_f_one_b_schedule(p, m), forward_cost=1, backward_cost=2, comm_cost=0.5)
    assert a.busy == b.busy == (12.0, 12.0, 12.0)
    assert a.makespan == m * 3 + (p - 1) * (3 + 2 * 0.5) == 20.0
    # 1F1B puts a round trip of latency on the critical path of its steady state
    assert b.makespan == 22.0
    # without communication cost both reach the ideal (m + p - 1)(f + b)
    for build in (gpipe_schedule, one_f_one_b_schedule):
        result = simulate(build(p, m), forward_cost=1, backward_cost=2)
        assert result.makespan == (m + p - 1) * 3


def test_build_schedule_validation() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zb-h1", 2, 2)
    with pytest.raises(ValueError, match="num_stages"):
        gpipe_schedule(0, 2)
    with pytest.raises(ValueError, match="num_micro_batches"):
        one_f_one_b_schedule(2, 0)
    with pytest.raises(TypeError):
        gpipe_schedule(2, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        simulate(())
    assert theoretical_bubble_fraction(4, 8) == 3 / 11
    assert theoretical_bubble_fraction(1, 5) == 0.0


def test_message_tags_are_distinct_offsets_in_the_pipelines_range() -> None:
    m = 8
    tags = {message_tag(step, mb, d, m)
            for step in range(TAG_STEP_WINDOW) for mb in range(m) for d in Direction}
    assert len(tags) == TAG_STEP_WINDOW * m * 2
    assert min(tags) == 0
    assert max(tags) < VALIDATE_OFFSET
    assert message_tag(TAG_STEP_WINDOW, 0, Direction.ACTIVATION, m) == 0
    assert message_tag(1, 2, Direction.GRAD, 4) == (1 * 4 + 2) * 2 + 1
    with pytest.raises(ValueError, match="micro_batch 4"):
        message_tag(0, 4, Direction.GRAD, 4)
    with pytest.raises(ValueError, match="too large"):
        message_tag(0, 0, Direction.GRAD, 10**6)
    with pytest.raises(ValueError, match="step"):
        message_tag(-1, 0, Direction.GRAD, 4)
