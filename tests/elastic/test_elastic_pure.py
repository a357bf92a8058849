"""The PURE parts of elastic training: the sampler's accounting, the membership rules, the
state's hash and the piece plan of a multi-donor fetch."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.elastic.membership import Membership, has_majority, next_order, parse_endpoint
from netdist.elastic.sampler import ElasticSampler
from netdist.elastic.state import ElasticState, state_digest
from netdist.elastic.transfer import plan_pieces


def test_every_sample_once_per_epoch_across_discards_and_membership_changes() -> None:
    sampler = ElasticSampler(num_samples=103, global_batch=10, seed=5)
    rng = np.random.default_rng(0)
    counts = np.zeros((4, 103), dtype=np.int64)
    world = 4
    while sampler.data_epoch < 4:
        world = int(rng.integers(1, 7))  # membership changes between attempts
        batches = [sampler.batch(r, world) for r in range(world)]
        assert sum(len(b) for b in batches) == len(sampler.global_ids())
        if rng.random() < 0.3:
            continue  # the attempt was discarded: nothing counted, position unchanged
        epoch = sampler.data_epoch
        for batch in batches:
            np.add.at(counts[epoch], batch, 1)
        sampler.advance()
    assert (counts == 1).all()


def test_sampler_position_travels_in_the_state() -> None:
    a = ElasticSampler(50, 7, seed=1)
    for _ in range(9):
        a.advance()
    b = ElasticSampler(50, 7, seed=1)
    b.load_state_array(a.state_array())
    assert np.array_equal(a.global_ids(), b.global_ids()) and b.data_epoch == 1


def test_sampler_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="global_batch"):
        ElasticSampler(10, 11)
    with pytest.raises(ValueError, match="rank 3"):
        ElasticSampler(10, 5).batch(3, 3)


def test_only_a_strict_majority_carries_on() -> None:
    assert has_majority([0, 1, 2, 3, 4], [0, 2, 4])
    assert not has_majority([0, 1, 2, 3], [0, 1])
    assert not has_majority([0, 1, 2], [2, 7, 8])  # joiners do not count


def test_order_keeps_survivors_first_then_joiners_by_slot() -> None:
    assert next_order([3, 0, 2], [0, 2], [5, 1]) == (0, 2, 1, 5)
    members = Membership(4, (3, 1), ("h:1", "h:2"))
    assert members.leader == 3 and members.rank_of(1) == 1 and members.endpoint_of(1) == "h:2"
    with pytest.raises(ValueError, match="repeat"):
        Membership(1, (1, 1), ("a:1", "b:2"))
    assert parse_endpoint("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_endpoint("nohost")


def test_pieces_cover_every_byte_once_and_spread_over_donors() -> None:
    sizes = [10, 0, 1000, 77]
    pieces = plan_pieces(sizes, 3, piece_bytes=64)
    for index, size in enumerate(sizes):
        covered = np.zeros(size, dtype=int)
        for p in pieces:
            if p.index == index:
                covered[p.start:p.stop] += 1
        assert (covered == 1).all()
    assert {p.donor for p in pieces} == {0, 1, 2}


def test_digest_changes_with_any_byte_the_step_or_the_layout() -> None:
    w = np.arange(6, dtype=np.float64)
    state = ElasticState({"w": w})
    base = state_digest(state.arrays(), 3)
    assert state_digest(state.arrays(), 4) != base
    assert state_digest({"w": w.reshape(2, 3)}, 3) != base
    w[5] = np.nextafter(w[5], 10)
    assert state_digest(state.arrays(), 3) != base


def test_state_loads_in_place_and_through_callables() -> None:
    w = np.zeros(3)
    state = ElasticState({"w": w})
    state.load({"w": np.array([1.0, 2.0, 3.0])})
    assert w.tolist() == [1.0, 2.0, 3.0]
    got = {}
    other = ElasticState(state_dict=lambda: {"v": np.ones(2)}, load_state_dict=got.update)
    other.load({"v": np.full(2, 4.0)})
    assert got["v"].tolist() == [4.0, 4.0]
    with pytest.raises(ValueError, match="either"):
        ElasticState()


def test_handed_back_ids_come_first_and_stay_in_their_epoch() -> None:
    sampler = ElasticSampler(num_samples=20, global_batch=6, seed=9)
    counts = np.zeros((3, 20), dtype=np.int64)
    rng = np.random.default_rng(1)
    while sampler.data_epoch < 3:
        ids = sampler.global_ids()
        lost = ids[rng.random(len(ids)) < 0.3]  # a lost member's share, handed back
        used = ids[~np.isin(ids, lost)]
        np.add.at(counts[sampler.data_epoch], used, 1)
        sampler.advance(skipped=lost)
        if len(lost):
            assert np.array_equal(sampler.global_ids()[:len(lost)], lost)
        restored = ElasticSampler(20, 6, seed=9)
        restored.load_state_array(sampler.state_array())
        assert np.array_equal(restored.global_ids(), sampler.global_ids())
    assert (counts == 1).all()
    with pytest.raises(ValueError, match="belong"):
        sampler.advance(skipped=np.array([999]))
