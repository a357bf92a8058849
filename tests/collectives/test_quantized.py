"""``QuantizedReducer``: results bitwise equal on every rank and to a one-process
reference of the documented definition (flat and two-level), the documented error bound
of the sum, error feedback, failures on every rank, and a real 4-process job on a fake
2-host layout whose cross-host bytes are ~1/4 of a float32 all-reduce's."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest

from netdist.collectives import Group, QuantizedReducer
from netdist.compression import Quantization, dequantize, error_bound, quantize
from netdist.errors import ConfigError, NetdistTimeoutError, QuantizationError
from netdist.sharding import chunk_bounds
from netdist.transport import local_tcp_group
from netdist.types import ReduceOp
from tests.ranks import finish_ranks, run_ranks, start_ranks

U = 2.0 ** -24  # float32 unit roundoff
FORMATS = ["int8:minmax:64", "int8:absmax:64", "int4:minmax:64", "int4:absmax:64"]


def _inputs(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    return [(np.random.default_rng(seed + r).standard_normal(size) * (r + 1))
            .astype(np.float32) for r in range(n)]


def _decoded(x: np.ndarray, q: Quantization) -> np.ndarray:
    return dequantize(quantize(x, q), x.size, q)


def _reference(contributions: Sequence[np.ndarray], bounds: Sequence[tuple[int, int]],
               q: Quantization, divisor: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented result, computed in one process: per shard, the contributions
    decoded and summed in float32 in order, divided once, then re-quantized. Returns the
    all-reduce result and the float32 sums (the reduce-scatter results)."""
    size = contributions[0].size
    result, sums = np.empty(size, np.float32), np.empty(size, np.float32)
    for lo, hi in bounds:
        acc = _decoded(contributions[0][lo:hi], q)
        for c in contributions[1:]:
            acc = acc + _decoded(c[lo:hi], q)
        if divisor > 1:
            acc = acc / np.float32(divisor)
        sums[lo:hi] = acc
        result[lo:hi] = _decoded(acc, q)
    return result, sums


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


# --------------------------------------------------------------------------- flat


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 3, 130, 1000])
async def test_every_rank_gets_the_reference_bits(n: int, size: int) -> None:
    """Sizes smaller than the world, not divisible by the chunk (64) or by the world."""
    inputs = _inputs(n, size)
    for text in FORMATS:
        q = Quantization.parse(text)
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            async def body(group: Group) -> tuple[str, np.ndarray, np.ndarray]:
                reducer = QuantizedReducer(group, text)
                assert reducer.path == "flat"
                mine = inputs[group.rank].copy()
                shard = await reducer.reduce_scatter(mine, op)
                assert np.array_equal(mine, inputs[group.rank])  # not modified
                await reducer.all_reduce(mine, op)
                return _digest(mine), mine, shard

            results = await run_ranks(n, body)
            assert len({digest for digest, _, _ in results}) == 1, (text, op)
            want, sums = _reference(inputs, chunk_bounds(size, n), q,
                                    n if op is ReduceOp.MEAN else 1)
            assert np.array_equal(results[0][1], want), (text, op)
            for rank, (lo, hi) in enumerate(chunk_bounds(size, n)):
                assert np.array_equal(results[rank][2], sums[lo:hi]), (text, op, rank)


@pytest.mark.parametrize("text", FORMATS)
async def test_the_sum_is_within_the_documented_bound(text: str) -> None:
    """|result - exact sum| <= sum_r b(x_r) + (n-1) 2**-23 sum_r |y_r| + b(S): each
    rank's quantization, the float32 sum of the decoded y_r, the re-quantization of
    that sum S (docs/collectives.md)."""
    n, size, q = 3, 1000, Quantization.parse(text)
    inputs = _inputs(n, size, seed=5)
    inputs[1][200:264] = 1e-3  # a chunk of tiny values beside large ones
    inputs[2][:64] = 0.0

    async def body(group: Group) -> np.ndarray:
        x = inputs[group.rank].copy()
        return await QuantizedReducer(group, q).all_reduce(x)

    result = (await run_ranks(n, body))[0]
    exact = np.sum(np.array(inputs, np.float64), axis=0)
    bound = np.zeros(size)
    for lo, hi in chunk_bounds(size, n):
        decoded = [_decoded(x[lo:hi], q) for x in inputs]
        total = decoded[0] + decoded[1] + decoded[2]
        bound[lo:hi] = (sum(error_bound(x[lo:hi], q) for x in inputs)
                        + (n - 1) * 2 * U * np.sum(np.abs(decoded), axis=0)
                        + error_bound(total, q))
    assert (np.abs(result - exact) <= bound).all()
    assert np.abs(result - exact).max() > 0.1 * bound.max()  # quantized, not exact


async def test_error_feedback_mean_of_results_converges() -> None:
    """K all-reduces of the same inputs: with error feedback the mean of the results
    approaches the exact sum as 1/K; sum(results) + every residual is K x the exact sum."""
    n, size, steps = 3, 300, 200
    q = Quantization.parse("int4:minmax:64")
    inputs = _inputs(n, size, seed=9)
    exact = np.sum(np.array(inputs, np.float64), axis=0)

    async def body(group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        plain, compensated = QuantizedReducer(group, q), QuantizedReducer(
            group, q, error_feedback=True)
        once = await plain.all_reduce(inputs[group.rank].copy(), key="w")
        total = np.zeros(size)
        for _ in range(steps):
            total += await compensated.all_reduce(inputs[group.rank].copy(), key="w")
        own = compensated.feedback.residual("w")
        reduced = compensated.feedback.residual("w:reduced")
        assert own is not None and reduced is not None
        assert plain.feedback.keys() == []
        return once, total, own, reduced

    results = await run_ranks(n, body)
    once, total = results[0][0], results[0][1]
    assert all(np.array_equal(r[1], total) for r in results)
    residuals = sum(r[2].astype(np.float64) for r in results)
    owner_residual = np.concatenate([r[3] for r in results])
    # the identity, up to the float32 rounding of K steps' sums
    identity = total + owner_residual + residuals - steps * exact
    assert np.abs(identity).max() < steps * n * 8 * U * np.abs(exact).max()
    plain_error = np.abs(once - exact).max()
    fed_error = np.abs(total / steps - exact).max()
    step = max(float(np.ptp(x)) for x in inputs) * n / 15
    assert fed_error < step / 50  # about (n + 1) residuals of half a step, over K = 200
    assert fed_error < plain_error / 10


async def test_torch_tensor_and_strided_array_in_place() -> None:
    torch = pytest.importorskip("torch")
    inputs = _inputs(2, 50)

    async def body(group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        reducer = QuantizedReducer(group, "int8:absmax:8")
        tensor = torch.from_numpy(inputs[group.rank].copy())
        assert await reducer.all_reduce(tensor, "mean") is tensor
        wide = np.zeros((50, 2), np.float32)
        column = wide[:, 1]
        column[:] = inputs[group.rank]
        await reducer.all_reduce(column, "mean")
        shard = await reducer.reduce_scatter(torch.from_numpy(inputs[group.rank]), "mean")
        return tensor.numpy(), wide, shard

    results = await run_ranks(2, body)
    want, _ = _reference(inputs, chunk_bounds(50, 2), Quantization(8, "absmax", 8), 2)
    for tensor, wide, shard in results:
        assert np.array_equal(tensor, want) and np.array_equal(wide[:, 1], want)
        assert (wide[:, 0] == 0).all() and isinstance(shard, np.ndarray)


async def test_bytes_sent_counts_the_quantized_payload() -> None:
    size, q = 1000, Quantization.parse("int8:minmax:64")

    async def body(group: Group) -> int:
        reducer = QuantizedReducer(group, q)
        await reducer.all_reduce(np.ones(size, np.float32))
        return reducer.bytes_sent

    sent = await run_ranks(3, body)
    widths = [q.wire_bytes(hi - lo) for lo, hi in chunk_bounds(size, 3)]
    for rank in range(3):
        to_others = sum(w for j, w in enumerate(widths) if j != rank)
        assert sent[rank] == to_others + 2 * max(widths)
    ring = 2 * (2 / 3) * 4 * size  # what a float32 ring all-reduce sends per rank
    assert max(sent) / ring == pytest.approx(q.wire_bytes(size) / (4 * size), rel=0.02)


# --------------------------------------------------------------------------- failures


async def test_a_non_finite_input_fails_every_rank_and_leaves_state_unchanged() -> None:
    inputs = _inputs(3, 200)

    async def body(group: Group) -> tuple[str, bool, bool, bool]:
        reducer = QuantizedReducer(group, "int8", error_feedback=True)
        await reducer.all_reduce(inputs[group.rank].copy(), key="w")  # residuals now held
        before = reducer.state_dict()
        x = inputs[group.rank].copy()
        if group.rank == 1:
            x[150] = np.nan  # in rank 2's shard
        with pytest.raises(QuantizationError) as caught:
            await reducer.all_reduce(x, key="w")
        unchanged = np.array_equal(x, inputs[group.rank], equal_nan=True) or group.rank == 1
        same_state = all(np.array_equal(v, reducer.state_dict()[k]) for k, v in before.items())
        again = inputs[group.rank].copy()  # the group is still in step
        await reducer.all_reduce(again, key="w")
        return str(caught.value), unchanged, same_state, bool(np.isfinite(again).all())

    results = await run_ranks(3, body)
    for rank, (message, unchanged, same_state, finite) in enumerate(results):
        assert "reduced shards of group rank(s) [2]" in message
        assert unchanged and same_state and finite
        assert ("this rank's (group rank 1) input" in message) == (rank == 1)
    assert "contributions of group rank(s) [1]" in results[2][0]


async def test_an_overflowing_sum_fails_every_rank() -> None:
    async def body(group: Group) -> str:
        x = np.full(10, 2.0 ** 126, np.float32)  # each quantizable, the sum is not
        with pytest.raises(QuantizationError) as caught:
            await QuantizedReducer(group, "int8:absmax").all_reduce(x)
        return str(caught.value)

    for message in await run_ranks(2, body):
        assert "reduced shards of group rank(s) [0, 1]" in message


async def test_reduce_scatter_fails_where_the_bad_value_went() -> None:
    async def body(group: Group) -> str:
        x = np.ones(30, np.float32)
        if group.rank == 1:
            x[3] = np.inf  # in rank 0's shard
        try:
            await QuantizedReducer(group, "int4").reduce_scatter(x)
        except QuantizationError as exc:
            return str(exc)
        return "ok"

    results = await run_ranks(3, body)
    assert "contributions of group rank(s) [1]" in results[0]
    assert "this rank's (group rank 1) contribution" in results[1]
    assert results[2] == "ok"


async def test_bad_arguments() -> None:
    async def body(group: Group) -> None:
        reducer = QuantizedReducer(group)
        with pytest.raises(ConfigError, match="SUM or MEAN.*max"):
            await reducer.all_reduce(np.ones(3, np.float32), "max")
        with pytest.raises(TypeError, match="float32, got float64"):
            await reducer.all_reduce(np.ones(3))
        with pytest.raises(ValueError, match="read-only"):
            await reducer.all_reduce(np.broadcast_to(np.float32(1), (3,)))
        with pytest.raises(ConfigError, match="'int3'"):
            QuantizedReducer(group, "int3")
        with pytest.raises(TypeError, match="Group"):
            QuantizedReducer(group.transport)  # type: ignore[arg-type]
        assert await reducer.all_reduce(np.ones(0, np.float32)) is not None

    await run_ranks(2, body)


async def test_a_missing_rank_times_out() -> None:
    async def body(group: Group) -> BaseException | None:
        if group.rank == 1:
            return None
        reducer = QuantizedReducer(group, timeout=0.5)
        with pytest.raises(NetdistTimeoutError):
            await reducer.all_reduce(np.ones(100, np.float32))
        return None

    await run_ranks(2, body)


# --------------------------------------------------------------------------- two-level


def _host_sums(inputs: Sequence[np.ndarray], host_ids: Sequence[str]) -> list[np.ndarray]:
    """Each host's float32 sum, hosts ordered by their lowest rank (two ranks per host:
    one addition, the same in any order)."""
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(host_ids):
        order.setdefault(host, []).append(rank)
    sums = []
    for members in order.values():
        acc = inputs[members[0]].copy()
        for r in members[1:]:
            acc = acc + inputs[r]
        sums.append(acc)
    return sums


@pytest.mark.parametrize("host_ids", [("a", "a", "b", "b"), ("a", "b", "a", "b"),
                                      ("a", "b", "c", "a", "b", "c")],
                         ids=["2x2", "2x2 interleaved", "3x2"])
async def test_two_level_gives_the_reference_bits(host_ids: tuple[str, ...]) -> None:
    """Across hosts: the host sums quantized, summed in host order, re-quantized, per
    world shard; every rank the same bits."""
    n, size = len(host_ids), 1001
    inputs = _inputs(n, size, seed=3)
    q = Quantization.parse("int8:minmax:64")
    want_sum, sums_sum = _reference(_host_sums(inputs, host_ids), chunk_bounds(size, n), q, 1)
    want_mean, sums_mean = _reference(_host_sums(inputs, host_ids), chunk_bounds(size, n),
                                      q, n)
    async with local_tcp_group(n, host_ids=list(host_ids), timeout=30) as transports:
        async def body(group: Group) -> tuple[str, ...]:
            reducer = QuantizedReducer(group, q, timeout=30)
            flat = QuantizedReducer(group, q, hierarchical=False)
            x = inputs[group.rank].copy()
            shard = await reducer.reduce_scatter(x)
            shard_mean = await reducer.reduce_scatter(x, "mean")
            await reducer.all_reduce(x)
            y = inputs[group.rank].copy()
            await reducer.all_reduce(y, "mean")
            lo, hi = chunk_bounds(size, n)[group.rank]
            assert np.array_equal(shard, sums_sum[lo:hi])
            assert np.array_equal(shard_mean, sums_mean[lo:hi])
            return reducer.path, flat.path, _digest(x), _digest(y)

        results = await run_ranks(transports, body)
    assert {r[:2] for r in results} == {("hierarchical", "flat")}
    assert {r[2] for r in results} == {_digest(want_sum)}
    assert {r[3] for r in results} == {_digest(want_mean)}


async def test_two_level_non_finite_fails_every_rank() -> None:
    async with local_tcp_group(4, host_ids=["a", "a", "b", "b"], timeout=30) as transports:
        async def body(group: Group) -> str:
            reducer = QuantizedReducer(group, "int4", error_feedback=True)
            x = np.ones(100, np.float32)
            if group.rank == 0:
                x[90] = -np.inf  # world shard 3
            with pytest.raises(QuantizationError) as caught:
                await reducer.all_reduce(x)
            assert reducer.state_dict() == {}
            return str(caught.value)

        messages = await run_ranks(transports, body)
    for rank, message in enumerate(messages):
        assert "reduced shards of group rank(s) [3]" in message, message
        assert ("this rank's (group rank 0) input" in message) == (rank == 0)


# --------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_four_processes_on_two_hosts() -> None:
    """Four processes, hosts told apart by NETDIST_HOST_ID: every rank the same bits,
    the two-level path, and ~1/4 of a float32 all-reduce's bytes across the hosts."""
    hosts = ["host0", "host0", "host1", "host1"]
    procs = start_ranks(4, "tests.collectives.quantized_worker", ["200003"], timeout=30,
                        job_prefix="quantized",
                        env=lambda rank: {"NETDIST_HOST_ID": hosts[rank]})
    outputs = []
    for rank, done in enumerate(finish_ranks(procs, timeout=120)):
        assert done.returncode == 0, f"rank {rank}:\n{done.stdout}"
        outputs.append(dict(line.split(" ", 1) for line in done.stdout.splitlines()
                            if line.split(" ", 1)[0] in ("PATH", "HASH", "CROSS", "OK")))
    assert {out["PATH"] for out in outputs} == {"hierarchical"}
    assert len({out["HASH"] for out in outputs}) == 1
    quantized = sum(int(out["CROSS"].split()[0]) for out in outputs)
    float32 = sum(int(out["CROSS"].split()[1]) for out in outputs)
    assert 0.24 < quantized / float32 < 0.27, (quantized, float32)
    assert all(out["OK"] == str(rank) for rank, out in enumerate(outputs))

