"""Pure parameter-server logic: placement, flat layouts, optimizers, the staleness rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netdist.errors import ConfigError, ParameterServerError
from netdist.optim import AdamConfig, SGDConfig, ShardOptimizer, optimizer_config_from_dict
from netdist.ps.messages import FlatLayout
from netdist.ps.placement import ParamSpec, plan_shards, specs_from_arrays
from netdist.ps.roles import num_servers_from_env, ps_roles
from netdist.ps.staleness import StalenessController, WorkerState
from netdist.sharding import chunk_bounds


def specs_of(sizes: list[int], dtype: str = "float64") -> list[ParamSpec]:
    return [ParamSpec(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]


def check_plan_invariants(sizes: list[int], num_servers: int, bound: int) -> None:
    plan = plan_shards(specs_of(sizes), num_servers, bigarray_bound=bound)
    # every element of every tensor is owned exactly once
    for key, size in enumerate(sizes):
        owned = np.zeros(size, dtype=np.int64)
        for s in plan.key_slices(key):
            owned[s.start:s.stop] += 1
        assert np.all(owned == 1)
        slices = plan.key_slices(key)
        if size >= bound and size >= num_servers:  # big: one slice on every server
            assert [s.server for s in slices] == list(range(num_servers))
            assert [s.size for s in slices] == [b - a for a, b in
                                                chunk_bounds(size, num_servers)]
        else:  # small: whole, on one server
            assert len(slices) == 1 and slices[0].start == 0 and slices[0].stop == size
    # each server's buffer is its slices back to back, in key order
    for server in range(num_servers):
        offset, last_key = 0, -1
        for s in plan.slices_of(server):
            assert s.server == server and s.offset == offset and s.key > last_key
            offset, last_key = offset + s.size, s.key
        assert plan.server_sizes[server] == offset
    # small tensors form contiguous, non-decreasing key ranges
    homes = [plan.key_slices(k)[0].server for k, n in enumerate(sizes)
             if not (n >= bound and n >= num_servers)]
    assert homes == sorted(homes)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=25), st.integers(1, 5),
       st.integers(1, 400))
def test_plan_owns_every_element_exactly_once(sizes: list[int], servers: int,
                                              bound: int) -> None:
    check_plan_invariants(sizes, servers, bound)


def test_plan_big_sliced_small_whole_and_balanced() -> None:
    sizes = [1000, 10, 20, 30, 40, 2000, 50, 60]
    plan = plan_shards(specs_of(sizes), 2, bigarray_bound=500)
    assert [s.server for s in plan.key_slices(0)] == [0, 1]
    assert [(s.start, s.stop) for s in plan.key_slices(5)] == [(0, 1000), (1000, 2000)]
    homes = {k: plan.key_slices(k)[0].server for k in (1, 2, 3, 4, 6, 7)}
    assert homes == {1: 0, 2: 0, 3: 0, 4: 0, 6: 1, 7: 1}  # 100 vs 110 small elements
    assert plan.server_sizes == (1600, 1610)
    assert plan.is_sliced(0) and not plan.is_sliced(1)


def test_plan_single_server_holds_everything_in_order() -> None:
    plan = plan_shards(specs_of([5, 3000, 7]), 1, bigarray_bound=10)
    assert [(s.key, s.offset, s.size) for s in plan.slices_of(0)] == [
        (0, 0, 5), (1, 5, 3000), (2, 3005, 7)]


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="share one dtype"):
        plan_shards([ParamSpec("a", (2,), "float32"), ParamSpec("b", (2,), "float64")], 2)
    with pytest.raises(TypeError, match="floating point"):
        plan_shards([ParamSpec("a", (2,), "int64")], 1)
    with pytest.raises(ValueError, match="unique"):
        plan_shards([ParamSpec("a", (2,), "float64"), ParamSpec("a", (3,), "float64")], 1)
    with pytest.raises(ValueError, match="num_servers"):
        plan_shards(specs_of([3]), 0)
    with pytest.raises(ValueError, match="at least one tensor"):
        plan_shards([], 2)


def test_pack_unpack_round_trip() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((30, 40)), rng.standard_normal(7), rng.standard_normal((3, 3)),
              rng.standard_normal(2500)]
    plan = plan_shards(specs_from_arrays(arrays), 3, bigarray_bound=1000)
    assert plan.is_sliced(0) and plan.is_sliced(3) and not plan.is_sliced(1)
    packed = [plan.pack(s, arrays) for s in range(3)]
    assert sum(p.size for p in packed) == sum(a.size for a in arrays)
    restored = [np.full_like(a, np.nan) for a in arrays]
    for s in range(3):
        plan.unpack(s, packed[s], restored)
    for a, b in zip(arrays, restored):
        assert a.tobytes() == b.tobytes()
    with pytest.raises(ValueError, match="shape"):
        plan.pack(0, [arrays[0].T, *arrays[1:]])
    with pytest.raises(ValueError, match="C-contiguous"):
        plan.unpack(0, packed[0], [np.zeros((40, 30)).T, *restored[1:]])


def test_specs_from_mapping_and_wire_round_trip() -> None:
    specs = specs_from_arrays({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    assert specs == (ParamSpec("w", (2, 3), "float32"), ParamSpec("b", (3,), "float32"))
    assert [ParamSpec.from_wire(s.to_wire()) for s in specs] == list(specs)
    with pytest.raises(ValueError):
        ParamSpec.from_wire(["w", [2, -1], "float32"])
    with pytest.raises(ValueError):
        ParamSpec.from_wire(["w", [2], "complex128"])


def test_flat_layout_groups_by_dtype() -> None:
    arrays = [np.arange(6.0).reshape(2, 3), np.arange(4, dtype=np.float32), np.arange(2.0)]
    layout = FlatLayout.from_arrays(arrays)
    assert layout.group_dtypes == ("float64", "float32")
    assert layout.group_sizes == (8, 4)
    assert layout.placement == ((0, 0, 6), (1, 0, 4), (0, 6, 2))
    flats = layout.flatten(arrays)
    np.testing.assert_array_equal(flats[0], [0, 1, 2, 3, 4, 5, 0, 1])
    views = layout.unflatten(flats)
    assert views[0].shape == (2, 3) and np.shares_memory(views[0], flats[0])
    out = [np.zeros_like(a) for a in arrays]
    layout.copy_into(flats, out)
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="tensor 0"):
        layout.check([np.zeros((3, 2)), *arrays[1:]])


# -- optimizers --------------------------------------------------------------------------


def reference_sgd(p, g, buf, lr, momentum, nesterov, wd):
    d = g + wd * p if wd else g
    if momentum:
        if buf is None:
            buf = d.copy()
        else:
            buf = momentum * buf + d
        d = d + momentum * buf if nesterov else buf
    return p - lr * d, buf


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.0),
                                                  (0.9, True, 1e-2)])
def test_sharded_sgd_equals_whole_tensor_sgd(momentum: float, nesterov: bool, wd: float) -> None:
    rng = np.random.default_rng(3)
    p = rng.standard_normal(101)
    config = SGDConfig(lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    whole = ShardOptimizer(config, 101, np.float64)
    halves = [ShardOptimizer(config, 50, np.float64), ShardOptimizer(config, 51, np.float64)]
    p_whole, p_shard = p.copy(), p.copy()
    ref, buf = p.copy(), None
    for _ in range(5):
        g = rng.standard_normal(101)
        whole.step(p_whole, g)
        halves[0].step(p_shard[:50], g[:50].copy())
        halves[1].step(p_shard[50:], g[50:].copy())
        ref, buf = reference_sgd(ref, g, buf, 0.05, momentum, nesterov, wd)
    assert p_whole.tobytes() == p_shard.tobytes()
    np.testing.assert_allclose(p_whole, ref, rtol=0, atol=1e-14)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_sharded_adam_equals_whole_tensor_adam(amsgrad: bool) -> None:
    rng = np.random.default_rng(4)
    p = rng.standard_normal(64).astype(np.float32)
    config = AdamConfig(lr=1e-2, weight_decay=1e-3, amsgrad=amsgrad)
    whole = ShardOptimizer(config, 64, np.float32)
    parts = [ShardOptimizer(config, 40, np.float32), ShardOptimizer(config, 24, np.float32)]
    a, b = p.copy(), p.copy()
    for _ in range(4):
        g = rng.standard_normal(64).astype(np.float32)
        whole.step(a, g)
        parts[0].step(b[:40], g[:40].copy())
        parts[1].step(b[40:], g[40:].copy())
    assert a.dtype == np.float32 and a.tobytes() == b.tobytes()
    assert whole.steps == 4


@pytest.mark.parametrize("config", [SGDConfig(lr=0.1, momentum=0.9, nesterov=True,
                                              weight_decay=1e-3),
                                    AdamConfig(lr=1e-2, weight_decay=1e-4)])
def test_shard_optimizer_matches_netdist_train(config) -> None:
    train = pytest.importorskip("netdist.train.optimizers")
    nn = pytest.importorskip("netdist.train.nn")
    rng = np.random.default_rng(5)
    shapes = [(4, 3), (3,), (2, 4)]
    params = [nn.Parameter(f"p{i}", rng.standard_normal(s)) for i, s in enumerate(shapes)]
    flat = np.concatenate([p.data.ravel() for p in params])
    if isinstance(config, SGDConfig):
        local = train.SGD(params, lr=config.lr, momentum=config.momentum,
                          nesterov=config.nesterov, weight_decay=config.weight_decay)
    else:
        local = train.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    shard_opt = ShardOptimizer(config, flat.size, np.float64)
    for _ in range(3):
        grads = [rng.standard_normal(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad[...] = g
        local.step()
        shard_opt.step(flat, np.concatenate([g.ravel() for g in grads]))
    assert np.concatenate([p.data.ravel() for p in params]).tobytes() == flat.tobytes()


def test_optimizer_config_round_trip_and_validation() -> None:
    for config in (SGDConfig(lr=0.1, momentum=0.5), AdamConfig(lr=0.01, amsgrad=True)):
        assert optimizer_config_from_dict(config.to_dict()) == config
    with pytest.raises(ValueError):
        optimizer_config_from_dict({"name": "rmsprop", "lr": 1})
    with pytest.raises(ValueError, match="unknown"):
        optimizer_config_from_dict({"name": "sgd", "lr": 1, "beta": 2})
    with pytest.raises(ValueError, match="Nesterov"):
        SGDConfig(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta1"):
        AdamConfig(beta1=1.0)


# -- staleness ---------------------------------------------------------------------------


def test_sync_rule_applies_all_workers_together() -> None:
    clock = StalenessController(3, 0)
    clock.on_push(0, 0)
    clock.on_push(2, 0)
    assert clock.next_update() is None and clock.blocked
    assert not clock.can_pull(0)
    clock.on_push(1, 0)
    assert clock.next_update() == (0, 1, 2)
    clock.commit((0, 1, 2))
    assert clock.version == 1 and all(clock.can_pull(w) for w in range(3))
    assert [e.staleness for e in clock.log] == [0, 0, 0]
    assert clock.on_pull(1) == 1
    clock.on_push(1, 1)
    assert clock.next_update() is None  # workers 0 and 2 have not pulled version 1 yet


def test_async_rule_applies_each_push_alone_in_arrival_order() -> None:
    clock = StalenessController(2, None)
    clock.on_push(1, 0)
    clock.on_push(0, 0)
    assert clock.next_update() == (1,)
    clock.commit((1,))
    assert clock.next_update() == (0,)
    clock.commit((0,))
    assert [(e.worker, e.worker_version, e.server_version) for e in clock.log] == [
        (1, 0, 0), (0, 0, 1)]
    clock.on_push(0, 0)  # fully async: pushing again without pulling is allowed
    assert clock.next_update() == (0,)
    clock.commit((0,))
    assert clock.log[-1].staleness == 2


def test_bounded_rule_holds_fast_workers_until_the_slow_one_pushes() -> None:
    clock = StalenessController(2, 2)
    for expected in range(2):  # worker 0 runs ahead by two versions
        clock.on_push(0, clock.base(0))
        assert clock.next_update() == (0,)
        clock.commit((0,))
        assert clock.on_pull(0) == expected + 1
    clock.on_push(0, 2)
    assert clock.next_update() is None and clock.blocked  # would leave worker 1 3 behind
    clock.on_push(1, 0)
    assert clock.next_update() == (1,)  # the oldest gradient goes first
    clock.commit((1,))
    assert clock.log[-1].staleness == 2
    assert clock.next_update() is None  # worker 1 is still at base 0 until it pulls
    clock.on_pull(1)
    assert clock.next_update() == (0,)


def test_a_pending_push_of_a_finished_worker_still_applies() -> None:
    clock = StalenessController(2, 0)
    clock.on_push(0, 0)
    clock.finish(0)
    assert clock.state(0) is WorkerState.PENDING and clock.active == [0, 1]
    with pytest.raises(ParameterServerError, match="after finishing"):
        clock.on_pull(0)
    assert clock.next_update() is None
    clock.on_push(1, 0)
    assert clock.next_update() == (0, 1)
    clock.commit((0, 1))
    assert clock.state(0) is WorkerState.DONE and clock.active == [1]
    clock.on_pull(1)
    clock.on_push(1, 1)
    assert clock.next_update() == (1,)  # alone now


def test_protocol_violations_are_errors() -> None:
    clock = StalenessController(2, 1)
    with pytest.raises(ParameterServerError, match="version 3"):
        clock.on_push(0, 3)
    clock.on_push(0, 0)
    with pytest.raises(ParameterServerError, match="before its previous push"):
        clock.on_push(0, 0)
    clock.commit(clock.next_update())
    with pytest.raises(ParameterServerError, match="without pulling"):
        clock.on_push(0, 0)
    clock.finish(1)
    with pytest.raises(ParameterServerError, match="after finishing"):
        clock.on_push(1, 0)
    with pytest.raises(ValueError):
        StalenessController(2, -1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.one_of(st.none(), st.integers(0, 4)),
       st.lists(st.integers(0, 4), min_size=1, max_size=120))
def test_staleness_bound_holds_and_never_deadlocks(workers: int, bound: int | None,
                                                   schedule: list[int]) -> None:
    """Random interleavings of pull -> push cycles; every worker does 5 pushes."""
    clock = StalenessController(workers, bound)
    remaining = [5] * workers

    def drain() -> None:
        while (update := clock.next_update()) is not None:
            clock.commit(update)

    def act(w: int) -> None:
        state = clock.state(w)
        if state is WorkerState.COMPUTING:
            if remaining[w] == 0:
                clock.finish(w)
            else:
                clock.on_push(w, clock.base(w))
                remaining[w] -= 1
        elif state is WorkerState.APPLIED:
            clock.on_pull(w)
        drain()

    for choice in schedule:
        act(choice % workers)
    for _ in range(20 * workers):  # then round-robin until everyone is done
        if clock.all_done:
            break
        for w in range(workers):
            act(w)
        # progress: if nobody is computing, something must have applied
        live = [w for w in clock.active if clock.state(w) is not WorkerState.PENDING]
        assert live or not clock.active
    assert clock.all_done
    assert len(clock.log) == 5 * workers
    if bound is not None:
        assert all(0 <= e.staleness <= bound for e in clock.log)
    if bound == 0:
        assert clock.version == 5  # one update per round: synchronous


def test_roles_and_env() -> None:
    roles = ps_roles(5, 2)
    assert list(roles.server_ranks) == [0, 1] and list(roles.worker_ranks) == [2, 3, 4]
    assert roles.worker_index(3) == 1 and roles.num_workers == 3
    with pytest.raises(ValueError):
        roles.worker_index(1)
    with pytest.raises(ConfigError):
        ps_roles(2, 2)
    assert num_servers_from_env({}) == 2  # DEFAULT_PS_SERVERS
    assert num_servers_from_env({"NETDIST_PS_SERVERS": "3"}) == 3
    with pytest.raises(ConfigError):
        num_servers_from_env({"NETDIST_PS_SERVERS": "x"})
    with pytest.raises(ConfigError):
        num_servers_from_env({"NETDIST_PS_SERVERS": "0"})


def test_segments_send_big_slices_alone_and_pack_small_ones() -> None:
    from netdist.ps.messages import plan_segments

    specs = [ParamSpec("a", (10,), "float64"), ParamSpec("big", (100_000,), "float64"),
             ParamSpec("b", (5,), "float64"), ParamSpec("c", (7,), "float64")]
    plan = plan_shards(specs, 2, bigarray_bound=1000)
    for server in range(2):
        segments = plan_segments(plan, server)
        covered = [(s.key, s.start, s.stop) for seg in segments for s in seg.slices]
        assert covered == [(s.key, s.start, s.stop) for s in plan.slices_of(server)]
        offset = 0
        for i, seg in enumerate(segments):
            assert seg.index == i and seg.offset == offset
            assert seg.size == sum(s.size for s in seg.slices)
            offset += seg.size
        assert offset == plan.server_sizes[server]
        big = [seg for seg in segments if seg.direct]
        assert len(big) == 1 and big[0].slices[0].key == 1
        assert all(len(seg.slices) >= 1 for seg in segments if not seg.direct)
    assert plan_segments(plan_shards(specs[:1], 1), 0)[0].direct is False


def test_one_packer_cuts_segments_and_pieces() -> None:
    from netdist.ps.messages import Run, pack_runs

    # 8-byte items: 1000 elements reach direct_bytes=8000; small runs break on dtype
    runs = pack_runs([3, 1000, 2, 2, 5, 1001], ["float64"] * 4 + ["float32", "float64"],
                     direct_bytes=8000)
    assert runs == (Run(((0, 0, 3),), False), Run(((1, 0, 1000),), True),
                    Run(((2, 0, 2), (3, 0, 2)), False), Run(((4, 0, 5),), False),
                    Run(((5, 0, 1001),), True))
    assert [r.size for r in runs] == [3, 1000, 4, 5, 1001]
    # with chunk_bytes: direct items in balanced chunks, packed runs capped
    chunked = pack_runs([3, 1000, 2, 2], ["float64"] * 4, direct_bytes=8000, chunk_bytes=3200)
    assert [r.parts for r in chunked] == [((0, 0, 3),), ((1, 0, 334),), ((1, 334, 667),),
                                          ((1, 667, 1000),), ((2, 0, 2), (3, 0, 2))]
    capped = pack_runs([3, 2, 2], ["float64"] * 3, direct_bytes=8000, chunk_bytes=40)
    assert [r.parts for r in capped] == [((0, 0, 3), (1, 0, 2)), ((2, 0, 2),)]  # 40 fits
    with pytest.raises(ValueError, match="chunk_bytes"):
        pack_runs([1], ["float64"], direct_bytes=8, chunk_bytes=0)


def test_pieces_cover_every_tensor_once_in_order() -> None:
    from netdist.ps.messages import plan_pieces

    arrays = [np.zeros(10), np.zeros(3, np.float32), np.zeros(4, np.float32),
              np.zeros(100_000), np.zeros(6), np.zeros(7)]
    layout = FlatLayout.from_arrays(arrays)
    pieces = plan_pieces(layout, chunk_bytes=300_000)
    assert [p.index for p in pieces] == list(range(len(pieces)))
    parts = [part for p in pieces for part in p.parts]
    assert parts == [(0, 0, 10), (1, 0, 3), (2, 0, 4), (3, 0, 33_334), (3, 33_334, 66_667),
                     (3, 66_667, 100_000), (4, 0, 6), (5, 0, 7)]
    assert [p.direct for p in pieces] == [False, False, True, True, True, False]
    assert [p.dtype for p in pieces] == ["float64", "float32", "float64", "float64",
                                         "float64", "float64"]
    packed = pieces[1].pack(arrays, np.empty(7, np.float32))
    assert packed.shape == (7,)
    assert pieces[2].view(arrays) is not None and pieces[0].view(arrays) is None
    with pytest.raises(ValueError):
        plan_pieces(layout, chunk_bytes=0)


# -- fault tolerance: replica layout, resumed clock ----------------------------------------


def test_replica_layout_is_a_ring_of_backups() -> None:
    from netdist.errors import ConfigError
    from netdist.ps import ReplicaLayout, replicas_from_env

    layout = ReplicaLayout(3, 1)
    assert [layout.backup(s) for s in range(3)] == [1, 2, 0]
    assert [layout.backed_up(r) for r in range(3)] == [2, 0, 1]
    assert ReplicaLayout(3).backup(0) is None and not ReplicaLayout(3).replicated
    with pytest.raises(ConfigError, match="needs 2"):
        ReplicaLayout(1, 1)
    with pytest.raises(ConfigError, match="0..1"):
        ReplicaLayout(2, 2)
    assert replicas_from_env({}) == 0
    assert replicas_from_env({"NETDIST_PS_REPLICAS": "1"}) == 1
    with pytest.raises(ConfigError, match="NETDIST_PS_REPLICAS"):
        replicas_from_env({"NETDIST_PS_REPLICAS": "2"})


def test_resumed_clock_waits_to_hear_every_worker_under_a_bound() -> None:
    from netdist.errors import ParameterServerError

    clock = StalenessController.resume(3, 1, version=5, log=[], done=[2])
    assert clock.active == [0, 1]
    assert not clock.base_known(0) and clock.base_known(2)
    with pytest.raises(ParameterServerError, match="version 6"):
        clock.report_base(0, 6)  # a version the backup never reached
    clock.report_base(0, 5)
    clock.on_push(0, 5)
    assert clock.next_update() is None  # worker 1 might be the slowest: not heard from yet
    clock.report_base(1, 4)
    assert clock.next_update() is None  # applying would leave worker 1 two versions behind
    clock.on_pull(1)  # worker 1 catches up
    assert clock.next_update() == (0,)
    # fully asynchronous: nothing to wait for
    free = StalenessController.resume(2, None, version=3, log=[], done=[])
    free.report_base(0, 3)
    free.on_push(0, 3)
    assert free.next_update() == (0,)


def test_finish_drops_a_worker_the_sync_barrier_waited_for() -> None:
    clock = StalenessController(3, 0)
    clock.on_push(1, 0)
    clock.on_push(2, 0)
    assert clock.next_update() is None  # waits for worker 0
    clock.finish(0)  # lost: the barrier shrinks to the workers left
    assert clock.next_update() == (1, 2)
