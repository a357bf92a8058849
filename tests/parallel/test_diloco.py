"""DiLoCo, Streaming DiLoCo and LocalSGD over in-process ranks: the exact algorithm.

Every test runs the real ``DiLoCo`` class on every rank of an ``InProcessTransport``
group and compares with a reference written out here, independently, in float64: the
inner steps of every worker, the mean of the outer gradients, Nesterov SGD, the
streaming schedule and the mixing. The global model must also be bitwise identical on
every rank (the outer step is computed on each rank separately).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest

from netdist.errors import ConfigError, NetdistError
from netdist.parallel.diloco import DiLoCo, DiLoCoConfig, LocalSGD
from netdist.parallel.fragments import FragmentSchedule, split_fragments
from netdist.parallel.outer_optim import OuterSGD
from tests import ranks

SHAPES = [(3, 4), (4,), (4, 2), (2,)]
INNER_LR = 0.1


def initial_params() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s) for s in SHAPES]


def targets(rank: int) -> list[np.ndarray]:
    """Worker ``rank``'s data: its loss pulls the parameters towards these."""
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(s) for s in SHAPES]


def inner_step(params: Sequence[np.ndarray], rank: int, step: int) -> None:
    """One SGD step on 0.5 * |x - target|^2 scaled by a step-dependent factor, in place."""
    for x, t in zip(params, targets(rank)):
        x -= INNER_LR * (1 + 0.1 * (step % 3)) * (x - t)


def digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def reference(world: int, steps: int, config: DiLoCoConfig,
              fragments: list[tuple[int, ...]], local_sgd: bool = False
              ) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """The global model and every worker's local model after ``steps``, written out."""
    schedule = config.schedule
    local = [initial_params() for _ in range(world)]
    global_ = initial_params()
    momentum = [np.zeros_like(g) for g in global_]
    pending: dict[int, list[np.ndarray]] = {}
    m, lr, a = config.outer_momentum, config.outer_lr, config.fragment_mixing

    def apply(p: int) -> None:
        avg = pending.pop(p)
        for j, i in enumerate(fragments[p]):
            if local_sgd:
                global_[i] = avg[j].copy()
            else:
                momentum[i] = m * momentum[i] + avg[j]
                global_[i] = global_[i] - lr * (avg[j] + m * momentum[i])
            for r in range(world):
                local[r][i] = a * local[r][i] + (1 - a) * global_[i]

    for t in range(1, steps + 1):
        for r in range(world):
            inner_step(local[r], r, t)
        if schedule.delay:
            for p in schedule.completed_after(t):
                apply(p)
        for p in schedule.launched_after(t):
            if local_sgd:
                pending[p] = [sum(local[r][i] for r in range(world)) / world
                              for i in fragments[p]]
            else:
                pending[p] = [sum(global_[i] - local[r][i] for r in range(world)) / world
                              for i in fragments[p]]
            if not schedule.delay:
                apply(p)
    for p in sorted(pending):
        apply(p)
    return global_, local


async def run_diloco(world: int, steps: int, config: DiLoCoConfig,
                     cls: type[DiLoCo] = DiLoCo) -> list[tuple[list[np.ndarray], list[np.ndarray], DiLoCo]]:
    async def body(rank: int, group: object) -> tuple[list[np.ndarray], list[np.ndarray], DiLoCo]:
        params = initial_params()
        diloco = cls(group, params, config)  # type: ignore[arg-type]
        for t in range(1, steps + 1):
            inner_step(params, rank, t)
            await diloco.step()
        await diloco.finish()
        return [g.copy() for g in diloco.global_arrays()], params, diloco

    return await ranks.run_ranks(world, body, with_rank=True)


@pytest.mark.parametrize("world", [1, 2, 3])
async def test_diloco_matches_the_reference_and_is_identical_on_every_rank(world: int) -> None:
    config = DiLoCoConfig(sync_every=5)
    results = await run_diloco(world, 23, config)
    want_global, want_local = reference(world, 23, config, [(0, 1, 2, 3)])
    assert len({digest(g) for g, _, _ in results}) == 1
    for rank, (got_global, got_local, diloco) in enumerate(results):
        for got, want in zip(got_global, want_global):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        for got, want in zip(got_local, want_local[rank]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert diloco.outer_steps == 4  # steps 5, 10, 15, 20
        assert [r.launched_after for r in diloco.records] == [5, 10, 15, 20]
        assert diloco.bytes_sent == 4 * sum(int(np.prod(s)) for s in SHAPES) * 8


async def test_after_a_sync_every_rank_restarts_from_the_same_bits() -> None:
    results = await run_diloco(3, 10, DiLoCoConfig(sync_every=5))
    assert len({digest(local) for _, local, _ in results}) == 1
    assert all(digest(local) == digest(g) for g, local, _ in results)


@pytest.mark.parametrize("fragments,delay,mixing", [(2, 0, 0.0), (2, 1, 0.0), (4, 1, 0.5),
                                                    (3, 1, 0.25)])
async def test_streaming_matches_the_reference(fragments: int, delay: int, mixing: float) -> None:
    config = DiLoCoConfig(sync_every=8, fragments=fragments, fragment_sync_delay=delay,
                          fragment_mixing=mixing)
    results = await run_diloco(3, 37, config)
    parts = split_fragments([int(np.prod(s)) for s in SHAPES], fragments)
    want_global, want_local = reference(3, 37, config, parts)
    assert len({digest(g) for g, _, _ in results}) == 1
    for rank, (got_global, got_local, diloco) in enumerate(results):
        assert diloco.fragments == parts
        for got, want in zip(got_global, want_global):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        for got, want in zip(got_local, want_local[rank]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        for record in diloco.records:
            expected = FragmentSchedule(8, fragments, delay).offset(record.fragment)
            assert record.launched_after % 8 == expected
            if record.launched_after + delay <= 37:
                assert record.completed_after == record.launched_after + delay


async def test_local_sgd_averages_the_parameters() -> None:
    config = DiLoCoConfig(sync_every=4)
    results = await run_diloco(2, 12, config, cls=LocalSGD)
    want_global, want_local = reference(2, 12, config, [(0, 1, 2, 3)], local_sgd=True)
    assert len({digest(local) for _, local, _ in results}) == 1
    for got_global, got_local, _ in results:
        for got, want in zip(got_global, want_global):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        for got, want in zip(got_local, want_local[0]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


async def test_state_dict_restores_a_joiner_to_the_global_model() -> None:
    async def body(rank: int, group: object) -> tuple[str, str]:
        params = initial_params()
        diloco = DiLoCo(group, params, DiLoCoConfig(sync_every=3))  # type: ignore[arg-type]
        for t in range(1, 7):
            inner_step(params, rank, t)
            await diloco.step()
        state = diloco.state_dict()
        fresh = [np.zeros(s) for s in SHAPES]
        joiner = DiLoCo(group, fresh, DiLoCoConfig(sync_every=3))  # type: ignore[arg-type]
        joiner.load_state_dict(state)
        assert joiner.inner_step == 6
        buffers = joiner.outer.buffers("fragment0")  # type: ignore[attr-defined]
        assert buffers is not None and digest(buffers) == digest(
            diloco.outer.buffers("fragment0"))  # type: ignore[attr-defined]
        return digest(fresh), digest(diloco.global_arrays())

    for joined, global_ in await ranks.run_ranks(2, body, with_rank=True):
        assert joined == global_


def test_outer_sgd_is_torch_sgd_with_nesterov() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    p = rng.standard_normal(10).astype(np.float32)
    t = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.SGD([t], lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterSGD()
    for _ in range(5):
        g = rng.standard_normal(10).astype(np.float32)
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        ours.step("x", [p], [g])
    # torch fuses ``a + alpha * b`` (one rounding where NumPy rounds twice): equal to
    # within a float32 ulp or two, not bitwise.
    np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_split_fragments_balances_elements_and_keeps_order() -> None:
    assert split_fragments([10, 10, 10, 10], 2) == [(0, 1), (2, 3)]
    assert split_fragments([100, 1, 1, 1], 2) == [(0,), (1, 2, 3)]
    assert split_fragments([1, 1, 1, 100], 3) == [(0, 1), (2,), (3,)]
    with pytest.raises(ConfigError, match="at least 5 parameters"):
        split_fragments([1, 2], 5)


def test_schedule_spreads_fragments_over_the_period() -> None:
    s = FragmentSchedule(100, 4, delay=10)
    assert [s.offset(p) for p in range(4)] == [25, 50, 75, 0]
    launched = {t: s.launched_after(t) for t in range(1, 201) if s.launched_after(t)}
    assert launched == {25: [0], 50: [1], 75: [2], 100: [3], 125: [0], 150: [1], 175: [2],
                        200: [3]}
    assert s.completed_after(35) == [0] and s.completed_after(110) == [3]
    with pytest.raises(ConfigError, match="fragment_sync_delay"):
        FragmentSchedule(100, 4, delay=25)
    with pytest.raises(ConfigError, match="cannot be staggered"):
        FragmentSchedule(3, 4)


async def test_bad_parameters_are_refused_clearly() -> None:
    async def body(group: object) -> None:
        with pytest.raises(ConfigError, match="float32 or float64"):
            DiLoCo(group, [np.zeros(3, dtype=np.int32)])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="empty parameter list"):
            DiLoCo(group, [])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="DiLoCo parameter 0"):
            DiLoCo(group, ["not an array"])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="every parameter index"):
            DiLoCo(group, [np.zeros(2), np.zeros(2)], DiLoCoConfig(fragments=2),  # type: ignore[arg-type]
                   fragments=[[0], [0]])
        d = DiLoCo(group, [np.zeros(2)], DiLoCoConfig(sync_every=2, fragment_sync_delay=1))  # type: ignore[arg-type]
        await d.step()
        await d.step()
        with pytest.raises(NetdistError, match="in flight"):
            d.state_dict()
        await d.finish()
        d.state_dict()

    await ranks.run_ranks(1, body)


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="fragment_mixing"):
        DiLoCoConfig(fragment_mixing=1.0)
    with pytest.raises(ConfigError, match="error_feedback needs"):
        DiLoCoConfig(error_feedback=True)
    with pytest.raises(ConfigError, match="sync_every"):
        DiLoCoConfig(sync_every=0)
    with pytest.raises(ConfigError, match="outer lr"):
        OuterSGD(lr=0)


@pytest.mark.parametrize("quantization,feedback", [("int8", False), ("int4", True),
                                                   ("int8:absmax:16", True)])
async def test_quantized_diloco_is_identical_on_every_rank_and_near_the_reference(
        quantization: str, feedback: bool) -> None:
    config = DiLoCoConfig(sync_every=4, quantization=quantization, error_feedback=feedback,
                          fragments=2, fragment_sync_delay=1)

    async def body(rank: int, group: object) -> tuple[str, str, list[np.ndarray], int]:
        params = [p.astype(np.float32) for p in initial_params()]
        diloco = DiLoCo(group, params, config)  # type: ignore[arg-type]
        for t in range(1, 22):
            inner_step(params, rank, t)
            await diloco.step()
        await diloco.finish()
        return (digest(diloco.global_arrays()), digest(params),
                [g.astype(np.float64) for g in diloco.global_arrays()], diloco.bytes_sent)

    results = await ranks.run_ranks(3, body, with_rank=True)
    assert len({r[0] for r in results}) == 1          # global model: the same bits
    parts = split_fragments([int(np.prod(s)) for s in SHAPES], 2)
    want_global, _ = reference(3, 21, dataclasses_replace(config), parts)
    bits = 8 if quantization.startswith("int8") else 4
    for got, want in zip(results[0][2], want_global):
        # outer steps amplify the quantization error a little; int4 keeps ~1/15 of a range
        np.testing.assert_allclose(got, want, atol=0.05 if bits == 8 else 0.5)
    float32_bytes = sum(int(np.prod(s)) for s in SHAPES) * 4 * 5  # 5 exchanges per fragment pair
    assert results[0][3] < float32_bytes


def dataclasses_replace(config: DiLoCoConfig) -> DiLoCoConfig:
    """The same schedule without quantization, for the float64 reference."""
    import dataclasses

    return dataclasses.replace(config, quantization=None, error_feedback=False)
