"""ElasticDiLoCo: the outer step equals a written-out float64 reference across membership
changes (in process, a simulated all-reduce), a discarded attempt leaves no trace, and in
a real elastic job a member SIGKILLed between outer steps is replaced by one that fetches
the global model and the outer momentum: every member ends bitwise equal."""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from netdist.elastic import ElasticDiLoCo
from netdist.errors import ConfigError
from netdist.parallel.outer_optim import OuterSGD
from tests.elastic.cluster import ElasticCluster

H = 4
INNER_LR = 0.1
OUTER_LR, OUTER_M = 0.7, 0.9
rng = np.random.default_rng(3)
X = rng.standard_normal((40, 3))
Y = X @ rng.standard_normal((3, 2)) + rng.standard_normal(2)


def make_inner(w: np.ndarray, b: np.ndarray) -> Callable[[np.ndarray], None]:
    def inner_step(ids: np.ndarray) -> None:
        residual = X[ids] @ w + b - Y[ids]
        w[...] -= INNER_LR * X[ids].T @ residual / len(ids)
        b[...] -= INNER_LR * residual.mean(axis=0)
    return inner_step


class Exchange:
    """A SUM all-reduce among ``n`` in-process members, summed in rank order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.payloads: dict[int, np.ndarray] = {}
        self.done = asyncio.Event()
        self.total: np.ndarray | None = None

    async def all_reduce(self, rank: int, array: np.ndarray) -> np.ndarray:
        self.payloads[rank] = array.copy()
        if len(self.payloads) == self.n:
            total = self.payloads[0].copy()
            for r in range(1, self.n):
                total = total + self.payloads[r]
            self.total = total
            self.done.set()
        await asyncio.wait_for(self.done.wait(), 10)
        assert self.total is not None
        return self.total.copy()


@dataclass
class FakeCtx:
    batch: np.ndarray | None
    global_count: int
    exchange: Exchange
    rank: int
    commits: list[Callable[[], None]] = field(default_factory=list)

    async def all_reduce(self, array: Any, op: Any = None) -> Any:
        return await self.exchange.all_reduce(self.rank, array)

    def on_commit(self, action: Callable[[], None]) -> None:
        self.commits.append(action)


class Member:
    def __init__(self) -> None:
        self.w = np.zeros((3, 2))
        self.b = np.zeros(2)
        self.diloco = ElasticDiLoCo([self.w, self.b], sync_every=H,
                                    outer=OuterSGD(OUTER_LR, OUTER_M))
        self.inner = make_inner(self.w, self.b)


async def outer_step(members: list[Member], ids: np.ndarray, *, commit: bool = True) -> None:
    shares = np.array_split(ids, len(members))
    exchange = Exchange(len(members))
    ctxs = [FakeCtx(share, len(ids), exchange, r) for r, share in enumerate(shares)]
    await asyncio.gather(*(m.diloco.step(c, m.inner) for m, c in zip(members, ctxs)))
    if commit:
        for c in ctxs:
            for action in c.commits:
                action()


class Reference:
    """DiLoCo written out: weighted mean of ``global - local``, Nesterov outer SGD."""

    def __init__(self) -> None:
        self.g = [np.zeros((3, 2)), np.zeros(2)]
        self.buf = [np.zeros((3, 2)), np.zeros(2)]

    def step(self, ids: np.ndarray, members: int) -> None:
        totals = [np.zeros((3, 2)), np.zeros(2)]
        for share in np.array_split(ids, members):
            w, b = self.g[0].copy(), self.g[1].copy()
            inner = make_inner(w, b)
            for micro in np.array_split(share, H):
                if len(micro):
                    inner(micro)
            for t, g, x in zip(totals, self.g, (w, b)):
                t += (g - x) * len(share)
        for i, total in enumerate(totals):
            grad = total / len(ids)
            self.buf[i] = OUTER_M * self.buf[i] + grad
            d = grad + OUTER_M * self.buf[i]
            self.g[i] = self.g[i] - OUTER_LR * d


def assert_matches(members: list[Member], ref: Reference) -> None:
    for m in members:
        for i in range(2):
            assert np.array_equal(m.diloco.global_arrays[i], ref.g[i])
            assert np.array_equal(m.diloco.momentum[i], ref.buf[i])
        assert np.array_equal(m.w, ref.g[0]) and np.array_equal(m.b, ref.g[1])
        state = m.diloco.state.arrays()
        assert list(state) == ["global.0", "global.1", "outer_momentum.0", "outer_momentum.1"]
        assert np.array_equal(state["outer_momentum.1"], ref.buf[1])


async def test_outer_steps_equal_the_reference_while_members_leave_and_join() -> None:
    order = np.random.default_rng(0).permutation(len(X))
    batches = [order[i * 12:(i + 1) * 12] for i in range(4)]
    members = [Member() for _ in range(3)]
    ref = Reference()
    await outer_step(members, batches[0])
    ref.step(batches[0], 3)
    assert_matches(members, ref)
    assert np.abs(ref.buf[0]).sum() > 0
    # a member leaves: the two others; one attempt is discarded first (no commit)
    await outer_step(members[:2], batches[1][:7], commit=False)
    await outer_step(members[:2], batches[1])
    ref.step(batches[1], 2)
    assert_matches(members[:2], ref)
    # a joiner fetches the state (what the job's transfer does), then trains with them
    joiner = Member()
    joiner.diloco.state.load(members[0].diloco.state.arrays())
    group = [members[0], joiner, members[1]]
    for batch in batches[2:]:
        await outer_step(group, batch)
        ref.step(batch, 3)
    assert_matches(group, ref)


def test_blocking_step_and_checks() -> None:
    w, b = np.zeros((3, 2)), np.zeros(2)
    diloco = ElasticDiLoCo([w, b], sync_every=H, outer=OuterSGD(OUTER_LR, OUTER_M))
    ids = np.arange(10)

    @dataclass
    class BlockingCtx:  # one member: the all-reduce is the identity
        batch: np.ndarray | None
        global_count: int
        commits: list[Callable[[], None]] = field(default_factory=list)

        def all_reduce(self, array: Any, op: Any = None) -> Any:
            return array

        def on_commit(self, action: Callable[[], None]) -> None:
            self.commits.append(action)

    ctx = BlockingCtx(ids, len(ids))
    diloco.step_blocking(ctx, make_inner(w, b))  # type: ignore[arg-type]
    assert len(ctx.commits) == 1 and not diloco.momentum[0].any()
    ctx.commits[0]()
    ref = Reference()
    ref.step(ids, 1)
    for i in range(2):
        assert np.allclose(diloco.global_arrays[i], ref.g[i], rtol=0, atol=1e-12)
        assert np.allclose(diloco.momentum[i], ref.buf[i], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="sampler"):
        diloco.step_blocking(BlockingCtx(None, 0), make_inner(w, b))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="float32 or float64"):
        ElasticDiLoCo([np.zeros(2, dtype=np.int64)])
    with pytest.raises(ConfigError, match="sync_every"):
        ElasticDiLoCo([np.zeros(2)], sync_every=0)


def test_outer_sgd_adopt_buffers_steps_the_given_arrays_in_place() -> None:
    live = [np.zeros(3), np.zeros((2, 2))]
    adopted, plain = OuterSGD(), OuterSGD()
    adopted.adopt_buffers("k", live)
    p1 = [np.ones(3), np.ones((2, 2))]
    p2 = [np.ones(3), np.ones((2, 2))]
    for scale in (1.0, -0.5):
        grads = [np.full(3, scale), np.full((2, 2), 2 * scale)]
        adopted.step("k", p1, grads)
        plain.step("k", p2, grads)
    got = adopted.buffers("k")
    assert got is not None and got[0] is live[0] and got[1] is live[1]
    expected = plain.buffers("k")
    assert expected is not None
    for a, e, x, y in zip(live, expected, p1, p2):
        assert np.array_equal(a, e) and np.array_equal(x, y)
    with pytest.raises(ConfigError, match="numpy.ndarray"):
        OuterSGD().adopt_buffers("k", [[0.0]])  # type: ignore[list-item]
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        OuterSGD().adopt_buffers("k", [frozen])


def _digests(final: dict[str, Any]) -> dict[int, str]:
    return {int(step): digest for step, digest in json.loads(str(final["digests"]))}


@pytest.mark.parametrize("how", ["compute:5", "outside"])
def test_member_killed_between_outer_steps_is_replaced_and_all_end_bitwise_equal(
        tmp_path: Path, how: str) -> None:
    steps = 20
    env = {"ELASTIC_TEST_UNTIL_WORLD": "3", "ELASTIC_TEST_STEP_SECONDS": "0.03"}
    if how != "outside":
        env.update(ELASTIC_TEST_DIE=how, ELASTIC_TEST_DIE_SLOT="1")
    cluster = ElasticCluster(tmp_path, 3, steps=steps, member="tests.elastic._diloco_member",
                             env=env)
    try:
        cluster.start_all()
        if how == "outside":
            cluster.wait_step(1, 4)
            cluster.kill(1)
        else:
            cluster.wait_until("slot 1 to die", lambda: cluster.procs[1].poll() is not None)
        assert cluster.procs[1].returncode == -signal.SIGKILL
        cluster.wait_until("the survivors to commit without it", lambda: (
            (p := cluster.progress(0)) is not None and p["world_size"] == 2 and p))
        cluster.start(1)
        assert cluster.wait_all(timeout=120) == {0: 0, 1: 0, 2: 0}
        finals = {slot: cluster.final(slot) for slot in range(3)}
        reference = finals[0]
        assert int(reference["step"]) >= steps
        assert np.abs(reference["momentum"]).sum() > 0
        for slot, final in finals.items():
            assert int(final["step"]) == int(reference["step"]), slot
            assert np.array_equal(final["global_model"], reference["global_model"]), slot
            assert np.array_equal(final["momentum"], reference["momentum"]), slot
            assert np.array_equal(final["local"], reference["global_model"]), slot
        # the joiner fetched from two donors, and what it fetched is what they held
        epoch, slots, _, fetched, donors = finals[1]["changes"][0]
        assert fetched > 0 and donors == 2, finals[1]["changes"]
        joined = _digests(finals[1])
        first = min(joined)
        assert first > 0
        for donor in (0, 2):
            held = _digests(finals[donor])
            assert held[first] == joined[first], donor
            assert all(held[s] == joined[s] for s in joined), donor
        assert [len(c[1]) for c in finals[0]["changes"]] == [3, 2, 3], finals[0]["changes"]
    finally:
        cluster.close()
