"""Pure schedule tests: build every rank's plan in one process and play the messages
through plain FIFO queues (no asyncio), checking matching, byte counts and results."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from netdist.transport.dissemination import barrier_partners
from netdist.collectives.plan import (
    binomial_tree,
    bruck_allgather_plan,
    chain_broadcast_plan,
    offsets_from_sizes,
    recursive_doubling_plan,
    ring_all_gather_plan,
    ring_all_reduce_plan,
    ring_plan,
    ring_reduce_scatter_plan,
    segment_bounds,
)
from netdist.sharding import chunk_bounds

WORLD_SIZES = list(range(1, 10))


def test_segment_bounds_split_evenly() -> None:
    assert segment_bounds(10, 10, 4) == ()
    assert segment_bounds(0, 10, 4) == ((0, 4), (4, 7), (7, 10))
    assert segment_bounds(5, 8, 100) == ((5, 8),)
    with pytest.raises(ValueError):
        segment_bounds(0, 4, 0)
    assert offsets_from_sizes([2, 0, 3]) == ((0, 2), (2, 2), (2, 5))


def _simulate_ring(plans, data, *, reduce_mode: str, policy: str, seed: int = 0):
    """Play ring plans for all ranks.

    reduce_mode "inplace": recvs of reduce steps combine into the rank's own buffer (the
    all-reduce executor); "slots": the non-destructive reduce-scatter executor, with a
    two-slot scratch area per rank whose reuse is governed by ``slot_after_send``.
    Returns per-rank buffers (inplace) or per-rank outputs (slots).
    """
    n = len(plans)
    rng = random.Random(seed)
    bufs = [d.copy() for d in data]
    chunks = plans[0].chunks
    longest = max((b - a for a, b in chunks), default=0)
    slots = [[np.full(longest, -999, np.int64), np.full(longest, -999, np.int64)]
             for _ in range(n)]
    own = [chunk_bounds(data[0].size, n)[r] for r in range(n)]
    outs = [np.full(own[r][1] - own[r][0], -999, np.int64) for r in range(n)]
    queues: dict[tuple[int, int], deque] = {}
    sent = [0] * n
    received = [0] * n
    first = plans[0].first_step
    last = first + plans[0].num_steps - 1

    def slot_view(r, step, chunk, start, stop):
        if step == last:
            return outs[r][start - own[r][0]:stop - own[r][0]]
        c0 = chunks[chunk][0]
        return slots[r][step % 2][start - c0:stop - c0]

    def try_send(r) -> bool:
        plan = plans[r]
        if sent[r] >= len(plan.sends):
            return False
        s = plan.sends[sent[r]]
        if s.after_recv >= received[r]:
            return False
        if reduce_mode == "slots" and s.step > first:
            payload = slot_view(r, s.step - 1, s.chunk, s.start, s.stop).copy()
        else:
            payload = bufs[r][s.start:s.stop].copy()
        queues.setdefault((r, plan.send_to), deque()).append((s.step, s.chunk, s.start,
                                                              s.stop, payload))
        sent[r] += 1
        return True

    def try_recv(r) -> bool:
        plan = plans[r]
        if received[r] >= len(plan.recvs):
            return False
        q = queues.get((plan.recv_from, r))
        if not q:
            return False
        rv = plan.recvs[received[r]]
        if reduce_mode == "slots" and rv.slot_after_send >= sent[r]:
            return False
        step, chunk, start, stop, payload = q.popleft()
        assert (step, chunk, start, stop) == (rv.step, rv.chunk, rv.start, rv.stop)
        if reduce_mode == "slots":
            view = slot_view(r, rv.step, rv.chunk, rv.start, rv.stop)
            view[...] = payload
            view += data[r][rv.start:rv.stop]
        elif rv.reduce:
            bufs[r][rv.start:rv.stop] += payload
        else:
            bufs[r][rv.start:rv.stop] = payload
        received[r] += 1
        return True

    progress = True
    while progress:
        progress = False
        order = list(range(n))
        if policy == "random":
            rng.shuffle(order)
        for r in order:
            if policy == "receivers_first":
                while try_recv(r):
                    progress = True
                while try_send(r):
                    progress = True
            elif policy == "senders_first":
                while try_send(r):
                    progress = True
                while try_recv(r):
                    progress = True
            else:
                for _ in range(rng.randint(1, 3)):
                    if rng.random() < 0.5:
                        progress |= try_send(r)
                    else:
                        progress |= try_recv(r)
        if policy == "random" and not progress:  # random choices only: check for real
            progress = any(try_send(r) or try_recv(r) for r in range(n))
    for r in range(n):
        assert sent[r] == len(plans[r].sends), f"rank {r} stalled sending (deadlock)"
        assert received[r] == len(plans[r].recvs), f"rank {r} stalled receiving"
    assert all(not q for q in queues.values()), "a send had no matching recv"
    return bufs if reduce_mode == "inplace" else outs


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("total", [0, 1, 5, 17, 64])
@pytest.mark.parametrize("segment", [1, 3, 1000])
def test_ring_all_reduce_simulation_exact_sum(n: int, total: int, segment: int) -> None:
    rng = np.random.default_rng(n * 1000 + total)
    data = [rng.integers(-1000, 1000, total).astype(np.int64) for _ in range(n)]
    expected = np.sum(data, axis=0) if total else np.zeros(0, np.int64)
    plans = [ring_all_reduce_plan(r, n, total, segment) for r in range(n)]
    for policy in ("senders_first", "receivers_first", "random"):
        result = _simulate_ring(plans, data, reduce_mode="inplace", policy=policy, seed=n)
        for r in range(n):
            np.testing.assert_array_equal(result[r], expected)
    bounds = chunk_bounds(total, n)
    for r, plan in enumerate(plans):
        size = [b - a for a, b in bounds]
        # each rank sends all chunks but its own (reduce-scatter) and all but its right
        # neighbour's (all-gather): 2(n-1)/n of the data, never the accumulated buffer
        expected_sent = 0 if n == 1 else 2 * total - size[r] - size[(r + 1) % n]
        assert plan.sent_elements == expected_sent
        assert plan.received_elements == (0 if n == 1 else
                                           2 * total - size[r] - size[(r - 1) % n])


@pytest.mark.parametrize("n", [3, 5, 7])
def test_ring_is_not_the_accumulated_buffer_shortcut(n: int) -> None:
    # a rank's ones must be counted exactly once in every element
    data = [np.full(2 * n + 1, 10 ** r, np.int64) for r in range(n)]
    plans = [ring_all_reduce_plan(r, n, 2 * n + 1, 2) for r in range(n)]
    result = _simulate_ring(plans, data, reduce_mode="inplace", policy="random", seed=7)
    for r in range(n):
        assert set(result[r].tolist()) == {int("1" * n)}


@pytest.mark.parametrize("n", WORLD_SIZES[1:])
@pytest.mark.parametrize("total", [0, 2, 11, 40])
@pytest.mark.parametrize("segment", [1, 4, 1000])
def test_ring_reduce_scatter_slots_simulation(n: int, total: int, segment: int) -> None:
    rng = np.random.default_rng(total + 7 * n)
    data = [rng.integers(-50, 50, total).astype(np.int64) for _ in range(n)]
    expected = np.sum(data, axis=0) if total else np.zeros(0, np.int64)
    plans = [ring_reduce_scatter_plan(r, n, total, segment) for r in range(n)]
    bounds = chunk_bounds(total, n)
    for seed, policy in enumerate(["receivers_first", "senders_first"] + ["random"] * 5):
        outs = _simulate_ring(plans, data, reduce_mode="slots", policy=policy, seed=seed)
        for r in range(n):
            a, b = bounds[r]
            np.testing.assert_array_equal(outs[r], expected[a:b])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_all_gather_uneven(n: int) -> None:
    sizes = [(3 * r + 1) % 4 for r in range(n)]  # includes zero-sized shards
    chunks = offsets_from_sizes(sizes)
    total = sum(sizes)
    full = np.arange(total, dtype=np.int64)
    data = []
    for r in range(n):
        buf = np.full(total, -1, np.int64)
        a, b = chunks[r]
        buf[a:b] = full[a:b]
        data.append(buf)
    plans = [ring_all_gather_plan(r, n, chunks, 1) for r in range(n)]
    result = _simulate_ring(plans, data, reduce_mode="inplace", policy="random")
    for r in range(n):
        np.testing.assert_array_equal(result[r], full)


def test_ring_plan_rejects_bad_steps() -> None:
    with pytest.raises(ValueError):
        ring_plan(0, 3, ((0, 1), (1, 2), (2, 3)), 1, 0, 5)
    with pytest.raises(ValueError):
        ring_plan(0, 3, ((0, 1), (1, 2)), 1, 0, 2)
    with pytest.raises(ValueError):
        ring_all_reduce_plan(3, 3, 10, 1)


@pytest.mark.parametrize(("n", "root"), [(n, root) for n in WORLD_SIZES
                                          for root in sorted({0, 1, n // 2, n - 1}) if root < n])
def test_chain_broadcast_simulation(n: int, root: int) -> None:
    total = 13
    plans = [chain_broadcast_plan(r, n, root, total, 4) for r in range(n)]
    have = [np.zeros(total, np.int64) for _ in range(n)]
    have[root][:] = np.arange(total)
    # walk the chain in order; every hop receives from its predecessor
    order = [(root + i) % n for i in range(n)]
    for prev, cur in zip(order, order[1:]):
        assert plans[prev].send_to == cur and plans[cur].recv_from == prev
        for a, b in plans[cur].segments:
            have[cur][a:b] = have[prev][a:b]
    assert plans[root].recv_from == -1 and plans[order[-1]].send_to == -1
    for r in range(n):
        np.testing.assert_array_equal(have[r], np.arange(total))


def _simulate_doubling(n: int, values: list[np.ndarray], op) -> list[np.ndarray]:
    plans = [recursive_doubling_plan(r, n) for r in range(n)]
    cur = [v.copy() for v in values]
    # fold
    for r, p in enumerate(plans):
        if p.fold_recv_from >= 0:
            assert plans[p.fold_recv_from].fold_send_to == r
            cur[r] = op(cur[p.fold_recv_from], cur[r])
    rounds = {len(p.rounds) for p in plans if p.fold_send_to < 0}
    assert len(rounds) == 1
    for k in range(rounds.pop()):
        nxt = list(cur)
        for r, p in enumerate(plans):
            if p.fold_send_to >= 0:
                continue
            peer, peer_is_lower = p.rounds[k]
            assert plans[peer].rounds[k] == (r, not peer_is_lower)
            nxt[r] = op(cur[peer], cur[r]) if peer_is_lower else op(cur[r], cur[peer])
        cur = nxt
    for r, p in enumerate(plans):
        if p.fold_send_to >= 0:
            assert plans[p.fold_send_to].fold_recv_from == r
            cur[r] = cur[p.fold_send_to].copy()
    return cur


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_recursive_doubling_exact_and_bitwise_identical(n: int) -> None:
    ints = [np.array([r + 1, 10 ** r], np.int64) for r in range(n)]
    result = _simulate_doubling(n, ints, np.add)
    for r in range(n):
        np.testing.assert_array_equal(result[r], np.sum(ints, axis=0))
    rng = np.random.default_rng(n)
    floats = [rng.standard_normal(8) * 10.0 ** rng.integers(-8, 8, 8) for _ in range(n)]
    result = _simulate_doubling(n, floats, np.add)
    for r in range(1, n):
        assert result[r].tobytes() == result[0].tobytes()
    zeros = [np.array([0.0 if r % 2 else -0.0]) for r in range(n)]
    result = _simulate_doubling(n, zeros, np.maximum)
    for r in range(1, n):
        assert result[r].tobytes() == result[0].tobytes()


@pytest.mark.parametrize(("n", "root"), [(n, root) for n in WORLD_SIZES
                                          for root in sorted({0, 1, n // 2, n - 1}) if root < n])
def test_binomial_tree_spans_every_rank_once(n: int, root: int) -> None:
    nodes = [binomial_tree(r, n, root) for r in range(n)]
    assert nodes[root].parent == -1
    reached = {root}
    frontier = [root]
    while frontier:
        r = frontier.pop()
        for c in nodes[r].children:
            assert nodes[c].parent == r and c not in reached
            reached.add(c)
            frontier.append(c)
    assert reached == set(range(n))
    depth = max(bin((r - root) % n).count("1") for r in range(n))
    assert depth <= max(0, (n - 1).bit_length())


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bruck_allgather_delivers_every_block(n: int) -> None:
    plans = [bruck_allgather_plan(r, n) for r in range(n)]
    have = [{r} for r in range(n)]
    assert all(len(p) == (n - 1).bit_length() for p in plans)
    for k in range(len(plans[0])):
        incoming = [set() for _ in range(n)]
        for r, p in enumerate(plans):
            rnd = p[k]
            assert set(rnd.send_blocks) <= have[r]
            peer = plans[rnd.send_to][k]
            assert peer.recv_from == r and peer.recv_blocks == rnd.send_blocks
            incoming[rnd.send_to] |= set(rnd.send_blocks)
        for r in range(n):
            assert not incoming[r] & have[r], "a block was delivered twice"
            have[r] |= incoming[r]
    assert all(h == set(range(n)) for h in have)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_dissemination_partners_pair_up(n: int) -> None:
    plans = [barrier_partners(r, n) for r in range(n)]
    for r in range(n):
        for k, (send_to, recv_from) in enumerate(plans[r]):
            assert plans[send_to][k][1] == r and plans[recv_from][k][0] == r
