"""Group owns every tag: the three tag spaces stay apart, and reserved ranges agree across
ranks without a message, differ between owners and between successive reservations."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.collectives.tags import reserve_tags
from netdist.collectives.tags import (
    GROUP_FLAG,
    P2P_BIT,
    RANGE_SIZE,
    RESERVED_BIT,
    SEQ_MASK,
    SEQ_SHIFT,
    TagRange,
    group_id,
    group_tag_base,
    reserved_range,
)
from netdist.errors import CollectiveError
from netdist.parallel.pipeline import PipelineParallel
from netdist.parallel.stages import PipelineParallelConfig
from netdist.ps import ColocatedPS, ParameterServer, SGDConfig
from netdist.train.losses import softmax_cross_entropy
from netdist.train.nn import mlp
from netdist.transport import MAX_TAG, InProcessTransport


def _space(tag: int) -> str:
    if not tag & GROUP_FLAG:
        return "application"
    return "reserved" if tag & RESERVED_BIT else "group"


def test_group_tags_and_reserved_ranges_never_meet() -> None:
    for parts in [("root", 0), ("root", 1), ("child", 7, 3, (0, 1)), ("named", 1, "x", (2,))]:
        gid = group_id(*parts)
        base = group_tag_base(gid)
        highest = base | P2P_BIT | (P2P_BIT - 1) | (SEQ_MASK << SEQ_SHIFT) | 0xF
        assert _space(base) == _space(highest) == "group"
        assert highest <= MAX_TAG
    for owner in ["pipeline", "ps.sync", "ps.sharded"]:
        tags = reserved_range((0, 1, 2), owner, 5)
        assert _space(tags.tag(0)) == _space(tags.tag(RANGE_SIZE - 1)) == "reserved"
        assert tags.tag(RANGE_SIZE - 1) <= MAX_TAG
    assert _space(2**62 - 1) == "application"


def test_tag_range_is_bounded() -> None:
    tags = TagRange("x", base=1 << 40, size=16)
    assert tags.tag(15) == (1 << 40) + 15
    assert tags.tag(0) in tags and tags.tag(15) in tags and (1 << 40) + 16 not in tags
    with pytest.raises(ValueError, match="outside x's range 0..15"):
        tags.tag(16)
    with pytest.raises(ValueError, match="owner"):
        reserved_range((0,), "", 0)


def test_every_rank_reserves_the_same_ranges_in_the_same_order() -> None:
    transports = InProcessTransport.create_group(3, timeout=5)
    per_rank = []
    for t in transports:
        world = Group(t)
        sub = world.new_group([0, 2])
        per_rank.append([world.reserve_tags("ps.sync"), world.reserve_tags("ps.sync"),
                         world.reserve_tags("pipeline"),
                         reserve_tags(t, range(3), "ps.sync"),  # a bare transport: the world
                         sub.reserve_tags("ps.sync") if sub.is_member else None])
    first = per_rank[0]
    assert per_rank[1][:4] == first[:4] and per_rank[2] == first
    bases = [r.base for r in first]
    assert len(set(bases)) == len(bases)  # successive, other owners, other ranks: all apart
    assert all(r.owner in ("ps.sync", "pipeline") for r in first)


def test_a_colliding_reservation_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import netdist.collectives.tags as tags_module

    monkeypatch.setattr(tags_module, "reserved_range",
                        lambda ranks, owner, index: TagRange(owner, GROUP_FLAG | RESERVED_BIT))
    transport = InProcessTransport.create_group(2, timeout=5)[0]
    reserve_tags(transport, (0, 1), "a")
    with pytest.raises(CollectiveError, match="'b' on ranks \\[0, 1\\] collides with one of 'a'"):
        reserve_tags(transport, (0, 1), "b")


async def test_two_parameter_servers_on_one_group_keep_apart() -> None:
    """Two sync servers, rounds in flight at once, no tags given: each gets its own range
    and each averages only its own gradients."""
    transports = InProcessTransport.create_group(3, timeout=10.0)
    groups = [Group(t) for t in transports]
    firsts = [ParameterServer(g) for g in groups]
    seconds = [ParameterServer(t) for t in transports]  # a bare transport: the world's range
    assert len({ps.tags.base for ps in firsts}) == 1
    assert len({ps.tags.base for ps in seconds}) == 1
    assert firsts[0].tags.base != seconds[0].tags.base

    async def rank(r: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        a, b = await asyncio.gather(firsts[r].reduce_gradients([np.full(4, float(r))]),
                                    seconds[r].reduce_gradients([np.full(4, 10.0 * r)]))
        return a, b

    results = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(3))), 10)
    for a, b in results:
        np.testing.assert_array_equal(a[0], np.full(4, 1.0))
        np.testing.assert_array_equal(b[0], np.full(4, 10.0))


async def test_a_pipeline_and_a_sharded_ps_share_a_transport() -> None:
    """The pipeline and the sharded PS reserve apart; both run at once on ranks 0-1 and
    each gives exactly what it gives alone."""
    transports = InProcessTransport.create_group(2, timeout=10.0)
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 6)), rng.integers(0, 3, 4)
    reference = mlp([6, 8, 3], rng=np.random.default_rng(5), dtype=np.float64)
    expected, _ = softmax_cross_entropy(reference.forward(x)[0], y)

    pipes, servers = [], []
    for t in transports:
        layers = mlp([6, 8, 3], rng=np.random.default_rng(5), dtype=np.float64).layers
        pipes.append(PipelineParallel(t, layers[:2] if t.rank == 0 else layers[2:], config,
                                      loss_fn=softmax_cross_entropy))
        servers.append(ColocatedPS(t, num_servers=1))
    assert pipes[0].tags == pipes[1].tags and servers[0].client.tags == servers[1].client.tags
    assert pipes[0].tags.base != servers[0].client.tags.base

    async def rank(r: int) -> tuple[float | None, list[np.ndarray]]:
        await servers[r].init([np.zeros(2)], optimizer=SGDConfig(lr=1.0))
        loss, params = await asyncio.gather(
            pipes[r].train_step(x if r == 0 else None, y if r == 1 else None),
            servers[r].step([np.full(2, float(r + 1))]))
        await servers[r].close()
        return loss, params

    (loss0, p0), (loss1, p1) = await asyncio.wait_for(asyncio.gather(rank(0), rank(1)), 10)
    assert loss0 is None and loss1 == pytest.approx(expected, rel=1e-12)
    np.testing.assert_array_equal(p0[0], np.full(2, -1.5))  # 0 - 1.0 * mean(1, 2)
    np.testing.assert_array_equal(p1[0], p0[0])
