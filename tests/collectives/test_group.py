"""Group collectives over in-process transports, against NumPy references."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.transport import InProcessTransport
from netdist.sharding import chunk_bounds
from netdist.types import WIRE_DTYPES, ReduceOp
from tests.collectives.helpers import RING, SMALL, assert_bitwise_equal
from tests.ranks import run_ranks

ALGOS = {"small": SMALL, "ring": RING}
WORLD_SIZES = list(range(1, 10))


def _rank_data(rank: int, shape: tuple[int, ...], dtype: str = "int64") -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(-1000, 1000, shape).astype(dtype)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("shape", [(0,), (), (1,), (5,), (3, 37)], ids=str)
async def test_all_reduce_sum_exact(n: int, algo: str, shape: tuple[int, ...]) -> None:
    expected = sum(_rank_data(r, shape) for r in range(n))

    async def body(g: Group) -> np.ndarray:
        arr = _rank_data(g.rank, shape)
        result = await g.all_reduce(arr, timeout=5)
        assert result is arr
        return arr

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=48)
    for result in results:
        assert result.shape == shape
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 9])
async def test_all_reduce_float_bitwise_identical(n: int, algo: str) -> None:
    def data(rank: int) -> np.ndarray:
        rng = np.random.default_rng(rank)
        return rng.standard_normal(1001) * 10.0 ** rng.integers(-6, 6, 1001)

    async def body(g: Group) -> np.ndarray:
        return await g.all_reduce(data(g.rank), timeout=5)

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=256)
    assert_bitwise_equal(results)
    np.testing.assert_allclose(results[0], np.sum([data(r) for r in range(n)], axis=0),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [3, 6])
async def test_all_reduce_max_signed_zero_bitwise_identical(n: int, algo: str) -> None:
    async def body(g: Group) -> np.ndarray:
        arr = np.array([0.0 if g.rank % 2 else -0.0] * 7)
        return await g.all_reduce(arr, ReduceOp.MAX, timeout=5)

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=16)
    assert_bitwise_equal(results)


def _dtype_values(name: str, rank: int, size: int) -> np.ndarray:
    # small integer-valued data: every sum and max is exact in every dtype (even float16
    # and bfloat16), so the reference comparison can be exact
    values = (np.arange(size) * (rank + 3) + rank) % 5
    if name == "bool":
        return (values % 2).astype(bool)
    return values.astype(WIRE_DTYPES[name])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", list(WIRE_DTYPES))
async def test_all_reduce_every_dtype(dtype: str, op: ReduceOp, algo: str) -> None:
    n, size = 3, 50
    ufunc = np.add if op is ReduceOp.SUM else np.maximum
    expected = functools.reduce(ufunc, [_dtype_values(dtype, r, size) for r in range(n)])

    async def body(g: Group) -> np.ndarray:
        return await g.all_reduce(_dtype_values(dtype, g.rank, size), op, timeout=5)

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=16)
    assert_bitwise_equal(results)
    assert results[0].dtype == WIRE_DTYPES[dtype]
    np.testing.assert_array_equal(results[0], expected)
    if dtype == "bool":  # SUM and MAX of bools are logical or
        np.testing.assert_array_equal(
            results[0], np.logical_or.reduce([_dtype_values(dtype, r, size) for r in range(n)]))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [1, 3, 4])
async def test_all_reduce_other_ops(n: int, algo: str) -> None:
    data = [np.array([r + 1.0, -r, 2.0, 0.5 * r]) for r in range(n)]

    async def body(g: Group) -> dict[str, np.ndarray]:
        out = {}
        for op in ReduceOp:
            if not op.is_bitwise:
                out[op.name] = await g.all_reduce(data[g.rank].copy(), op, timeout=5)
        out["str"] = await g.all_reduce(data[g.rank].copy(), "max", timeout=5)
        return out

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=8)
    stacked = np.stack(data)
    for res in results:
        np.testing.assert_array_equal(res["SUM"], stacked.sum(0))
        np.testing.assert_allclose(res["MEAN"], stacked.sum(0) / n, rtol=0, atol=1e-15)
        np.testing.assert_array_equal(res["MAX"], stacked.max(0))
        np.testing.assert_array_equal(res["MIN"], stacked.min(0))
        np.testing.assert_array_equal(res["PROD"], stacked.prod(0))
        np.testing.assert_array_equal(res["str"], stacked.max(0))
    assert_bitwise_equal([r["MEAN"] for r in results])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_bitwise_ops(n: int, algo: str) -> None:
    data = [np.array([0b1100 | r, 0b1010, -1, 7 << r], np.int32) for r in range(n)]

    async def body(g: Group) -> dict[ReduceOp, np.ndarray]:
        return {op: await g.all_reduce(data[g.rank].copy(), op, timeout=5)
                for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)}

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=8)
    for res in results:
        np.testing.assert_array_equal(res[ReduceOp.BAND], np.bitwise_and.reduce(data))
        np.testing.assert_array_equal(res[ReduceOp.BOR], np.bitwise_or.reduce(data))
        np.testing.assert_array_equal(res[ReduceOp.BXOR], np.bitwise_xor.reduce(data))


@pytest.mark.parametrize("algo", ALGOS)
async def test_float_overflow_gives_inf_without_a_warning(algo: str) -> None:
    """As torch and Gloo do: a sum past float32's range is inf, not a RuntimeWarning
    (which pytest, and any program running with -W error, turns into a failure)."""
    async def body(g: Group) -> np.ndarray:
        return await g.all_reduce(np.full(64, 3e38, np.float32), timeout=5)

    for result in await run_ranks(2, body, small_message_bytes=ALGOS[algo], segment_bytes=64):
        assert np.isinf(result).all() and (result > 0).all()


async def test_bitwise_ops_refuse_floats() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(TypeError, match="BXOR needs an integer or bool dtype, got float32"):
            await g.all_reduce(np.ones(2, np.float32), ReduceOp.BXOR, timeout=5)

    await run_ranks(2, body)


async def test_all_reduce_bool_prod_min_are_logical_and() -> None:
    data = [np.array([True, True, False, True]), np.array([True, False, False, True]),
            np.array([True, True, True, True])]

    async def body(g: Group) -> list[np.ndarray]:
        return [await g.all_reduce(data[g.rank].copy(), op, timeout=5)
                for op in (ReduceOp.PROD, ReduceOp.MIN)]

    for result in await run_ranks(3, body):
        for arr in result:
            np.testing.assert_array_equal(arr, np.logical_and.reduce(data))


async def test_all_reduce_mean_of_integers_truncates_and_refuses_bool() -> None:
    """MEAN on integers is NCCL's average: the wrapped sum, divided toward zero (issue 27;
    it used to raise TypeError). bool has no mean."""
    async def body(g: Group) -> dict[str, np.ndarray]:
        out = {}
        for dtype in ("int32", "uint8"):
            array = np.array([3, 4, 250, -4, -3 - g.rank]).astype(dtype)
            out[dtype] = await g.all_reduce(array, ReduceOp.MEAN)
        with pytest.raises(TypeError, match="MEAN needs a floating or integer dtype, got bool"):
            await g.all_reduce(np.zeros(3, "bool"), ReduceOp.MEAN)
        with pytest.raises(ValueError, match="unknown reduce op"):
            await g.all_reduce(np.zeros(3), "median")
        return out

    for result in await run_ranks(2, body):
        # int32: 6/2, 8/2, 500/2, -8/2, -7/2 -> -3 (truncated, not floored to -4)
        assert result["int32"].dtype == np.int32
        assert result["int32"].tolist() == [3, 4, 250, -4, -3]
        # uint8: -4 is 252, 252 + 252 wraps to 248; -3, -4 are 253, 252: 505 wraps to 249
        assert result["uint8"].dtype == np.uint8
        assert result["uint8"].tolist() == [3, 4, (500 % 256) // 2, 124, 124]


async def test_all_reduce_non_contiguous_in_place() -> None:
    async def body(g: Group) -> np.ndarray:
        base = np.arange(40, dtype=np.float64).reshape(4, 10) * (g.rank + 1)
        view = base[:, ::3]
        await g.all_reduce(view, timeout=5)
        return base

    results = await run_ranks(3, body, small_message_bytes=RING, segment_bytes=8)
    expected = np.arange(40, dtype=np.float64).reshape(4, 10)
    expected[:, ::3] *= 6
    for r, base in enumerate(results):
        untouched = np.arange(40, dtype=np.float64).reshape(4, 10) * (r + 1)
        np.testing.assert_array_equal(base[:, ::3], expected[:, ::3])
        mask = np.ones(10, bool)
        mask[::3] = False
        np.testing.assert_array_equal(base[:, mask], untouched[:, mask])


async def test_all_reduce_rejects_bad_arrays() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(TypeError, match="numpy.ndarray"):
            await g.all_reduce([1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not supported"):
            await g.all_reduce(np.zeros(2, np.complex128))
        with pytest.raises(TypeError, match="big-endian"):
            await g.all_reduce(np.zeros(2, ">f8"))
        ro = np.zeros(2)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await g.all_reduce(ro)
        with pytest.raises(ValueError, match="timeout"):
            await g.all_reduce(np.zeros(2), timeout=0)

    await run_ranks(2, body)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("size", [0, 1, 7, 100])
async def test_reduce_scatter(n: int, algo: str, size: int) -> None:
    expected = sum(_rank_data(r, (size,)) for r in range(n))
    bounds = chunk_bounds(size, n)

    async def body(g: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arr = _rank_data(g.rank, (size,))
        shard = await g.reduce_scatter(arr, timeout=5)
        out = np.empty(bounds[g.rank][1] - bounds[g.rank][0], arr.dtype)
        again = await g.reduce_scatter(arr, ReduceOp.SUM, out=out, timeout=5)
        assert again is out
        return arr, shard, out

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=16)
    for r, (arr, shard, out) in enumerate(results):
        np.testing.assert_array_equal(arr, _rank_data(r, (size,)))  # input untouched
        a, b = bounds[r]
        assert shard.ndim == 1
        np.testing.assert_array_equal(shard, expected[a:b])
        np.testing.assert_array_equal(out, expected[a:b])


@pytest.mark.parametrize("algo", ALGOS)
async def test_reduce_scatter_2d_mean(algo: str) -> None:
    n = 3
    data = [np.arange(24, dtype=np.float32).reshape(4, 6) * (r + 1) for r in range(n)]

    async def body(g: Group) -> np.ndarray:
        return await g.reduce_scatter(data[g.rank], ReduceOp.MEAN, timeout=5)

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=8)
    expected = (sum(data) / n).reshape(-1)
    for r, shard in enumerate(results):
        a, b = chunk_bounds(24, n)[r]
        np.testing.assert_allclose(shard, expected[a:b], rtol=1e-6)


async def test_reduce_scatter_out_validation() -> None:
    async def body(g: Group) -> None:
        expected = 4 if g.rank == 0 else 3
        with pytest.raises(ValueError, match=rf"out= holds 5 elements .* has {expected}"):
            await g.reduce_scatter(np.zeros(10), out=np.zeros(5))
        with pytest.raises(ValueError, match="dtype"):
            await g.reduce_scatter(np.zeros(10), out=np.zeros(expected, np.float32))

    await run_ranks(3, body)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_all_gather_uneven(n: int, algo: str) -> None:
    def shard(rank: int) -> np.ndarray:
        rows = (rank * 2 + 1) % 4  # some ranks contribute zero rows
        return np.arange(rows * 3, dtype=np.int32).reshape(rows, 3) + 100 * rank

    expected = np.concatenate([shard(r) for r in range(n)])

    async def body(g: Group) -> np.ndarray:
        return await g.all_gather(shard(g.rank), timeout=5)

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=8)
    for result in results:
        assert result.shape == expected.shape
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
async def test_all_gather_into_out_lands_in_place(n: int, algo: str) -> None:
    total = 2 * n + 1
    full = np.arange(total * 2, dtype=np.float64).reshape(total, 2)
    bounds = chunk_bounds(total, n)

    async def body(g: Group) -> np.ndarray:
        a, b = bounds[g.rank]
        out = np.full((total, 2), -1.0)
        result = await g.all_gather(full[a:b].copy(), out=out, timeout=5)
        assert result is out
        # a shard that already is a view of its place in out= works too
        out2 = np.full((total, 2), -1.0)
        out2[a:b] = full[a:b]
        await g.all_gather(out2[a:b], out=out2, timeout=5)
        np.testing.assert_array_equal(out2, full)
        return out

    for result in await run_ranks(n, body, small_message_bytes=ALGOS[algo],
                                  segment_bytes=8):
        np.testing.assert_array_equal(result, full)


async def test_all_gather_0d_and_validation() -> None:
    async def body(g: Group) -> np.ndarray:
        result = await g.all_gather(np.array(g.rank * 1.5), timeout=5)
        with pytest.raises(ValueError, match=r"must contribute 2 rows .* has 1"):
            await g.all_gather(np.zeros((1, 2)), out=np.zeros((6, 2)))
        with pytest.raises(ValueError, match="expected"):
            await g.all_gather(np.zeros((2, 2)), out=np.zeros((6, 3)))
        return result

    for result in await run_ranks(3, body):
        np.testing.assert_array_equal(result, [0.0, 1.5, 3.0])


async def test_all_gather_mismatched_trailing_dims_fail_on_every_rank() -> None:
    from netdist.collectives import CollectiveMismatchError

    async def body(g: Group) -> None:
        shard = np.zeros((2, 3 if g.rank != 1 else 4))
        with pytest.raises(CollectiveMismatchError, match="group rank 1"):
            await g.all_gather(shard, timeout=5)

    await run_ranks(3, body)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_broadcast_from_every_source(n: int, algo: str) -> None:
    async def body(g: Group) -> list[np.ndarray]:
        results = []
        for src in range(n):
            arr = np.full((3, 11), g.rank, np.int16)
            assert await g.broadcast(arr, src, timeout=5) is arr
            results.append(arr)
        return results

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=10)
    for per_rank in results:
        for src, arr in enumerate(per_rank):
            np.testing.assert_array_equal(arr, np.full((3, 11), src, np.int16))


async def test_broadcast_validation() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(ValueError, match="outside"):
            await g.broadcast(np.zeros(2), 5)

    await run_ranks(2, body)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_reduce_to_each_root(n: int, algo: str) -> None:
    expected = sum(_rank_data(r, (23,)) for r in range(n))

    async def body(g: Group) -> list[np.ndarray]:
        results = []
        for dst in range(n):
            arr = _rank_data(g.rank, (23,))
            await g.reduce(arr, dst, timeout=5)
            results.append(arr)
        return results

    results = await run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=8)
    for r, per_rank in enumerate(results):
        for dst, arr in enumerate(per_rank):
            np.testing.assert_array_equal(arr, expected if r == dst else _rank_data(r, (23,)))


async def test_reduce_mean_and_max() -> None:
    async def body(g: Group) -> tuple[np.ndarray, np.ndarray]:
        a = np.array([1.0, 2.0]) * (g.rank + 1)
        b = np.array([g.rank, -g.rank], np.int8)
        await g.reduce(a, 2, ReduceOp.MEAN, timeout=5)
        await g.reduce(b, 2, ReduceOp.MAX, timeout=5)
        return a, b

    results = await run_ranks(4, body)
    np.testing.assert_array_equal(results[2][0], [2.5, 5.0])
    np.testing.assert_array_equal(results[2][1], [3, 0])


@pytest.mark.parametrize("n", [1, 2, 5])
async def test_gather_and_scatter_any_shapes(n: int) -> None:
    def item(rank: int) -> np.ndarray:
        return np.arange(rank + 1, dtype=np.float32) * (rank + 2)

    async def body(g: Group) -> tuple[object, np.ndarray]:
        gathered = await g.gather(item(g.rank), dst=n - 1, timeout=5)
        arrays = [item(r) * 10 for r in range(n)] if g.rank == 0 else None
        mine = await g.scatter(arrays, src=0, timeout=5)
        return gathered, mine

    results = await run_ranks(n, body)
    for r, (gathered, mine) in enumerate(results):
        if r == n - 1:
            assert isinstance(gathered, list) and len(gathered) == n
            for s, arr in enumerate(gathered):
                np.testing.assert_array_equal(arr, item(s))
        else:
            assert gathered is None
        np.testing.assert_array_equal(mine, item(r) * 10)


async def test_scatter_validation() -> None:
    async def body(g: Group) -> None:
        if g.rank == 0:
            with pytest.raises(ValueError, match="list of 3 arrays, got 2 arrays"):
                await g.scatter([np.zeros(1), np.zeros(1)], src=0)
            with pytest.raises(ValueError, match="got None"):
                await g.scatter(None, src=0)

    await run_ranks(3, body)


@pytest.mark.parametrize("n", WORLD_SIZES)
async def test_barrier(n: int) -> None:
    async def body(g: Group) -> int:
        for _ in range(3):
            await g.barrier(timeout=5)
        return g.rank

    assert await run_ranks(n, body) == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 6])
async def test_object_collectives(n: int) -> None:
    async def body(g: Group) -> tuple[list, object]:
        obj = {"rank": g.rank, "name": f"w{g.rank}", "blob": bytes(g.rank), "f": 0.5,
               "nested": [1, (2, 3), None, True]}
        gathered = await g.all_gather_object(obj, timeout=5)
        got = await g.broadcast_object({"step": 7, "ranks": list(range(g.rank + 1))}
                                       if g.rank == n - 1 else None, src=n - 1, timeout=5)
        return gathered, got

    for gathered, got in await run_ranks(n, body):
        assert gathered == [{"rank": r, "name": f"w{r}", "blob": bytes(r), "f": 0.5,
                             "nested": [1, [2, 3], None, True]} for r in range(n)]
        assert got == {"step": 7, "ranks": list(range(n))}


async def test_object_collectives_refuse_non_msgpack_on_every_rank() -> None:
    from netdist.errors import CollectiveError

    class Opaque:
        pass

    async def body(g: Group) -> None:
        obj = Opaque() if g.rank == 1 else {"ok": g.rank}
        if g.rank == 1:
            with pytest.raises(TypeError, match="cannot be encoded with msgpack"):
                await g.all_gather_object(obj, timeout=5)
        else:
            with pytest.raises(CollectiveError, match="group rank 1 could not send"):
                await g.all_gather_object(obj, timeout=5)
        if g.rank == 0:
            with pytest.raises(TypeError, match="never pickles"):
                await g.broadcast_object(np.zeros(2), src=0, timeout=5)
        else:
            with pytest.raises(CollectiveError, match="group rank 0"):
                await g.broadcast_object(None, src=0, timeout=5)
        # the group still works afterwards
        assert await g.all_gather_object(g.rank, timeout=5) == [0, 1, 2]

    await run_ranks(3, body)


@pytest.mark.parametrize("size", [4, 3000])  # checked dtype/shape, pooled scratch
async def test_mismatched_sizes_are_reported_not_corrupted(size: int) -> None:
    from netdist.collectives import CollectiveMismatchError
    from netdist.errors import NetdistTimeoutError

    async def body(g: Group) -> str:
        arr = np.zeros(size if g.rank != 2 else size + 1)
        # the ranks that exchange with rank 2 see the mismatch; the rest time out
        with pytest.raises((CollectiveMismatchError, NetdistTimeoutError)) as info:
            await g.all_reduce(arr, timeout=1)
        return type(info.value).__name__

    results = await run_ranks(4, body)
    assert results[2] == results[3] == "CollectiveMismatchError"


async def test_group_defaults_and_identity() -> None:
    async def body(g: Group) -> tuple[int, float]:
        assert g.world_size == 3 and g.ranks == (0, 1, 2) and g.is_member
        assert g.rank == g.transport.rank
        return g.group_id, g.timeout

    results = await run_ranks(3, body, op_timeout=7.0)
    assert {gid for gid, _ in results} == {results[0][0]}
    assert all(t == 7.0 for _, t in results)


def test_segment_sizes_adapt_to_the_message() -> None:
    from netdist.collectives.routes import MIN_SEGMENT_BYTES, PIECES, segment_elements

    transport = InProcessTransport.create_group(1)[0]
    g = Group(transport, segment_bytes=4 << 20)
    f4 = np.dtype(np.float32).itemsize
    assert segment_elements(f4, 256 << 20, PIECES, g.segment_bytes) == (4 << 20) // 4  # capped at segment_bytes
    assert segment_elements(f4, 4 << 20, 4, g.segment_bytes) == (1 << 20) // 4  # a quarter of the chunk
    assert segment_elements(f4, 100, 4, g.segment_bytes) == MIN_SEGMENT_BYTES // 4  # never below the minimum
    tiny = Group(transport, segment_bytes=64)
    assert segment_elements(f4, 4 << 20, 4, tiny.segment_bytes) == 16  # an explicit small segment_bytes wins
    with pytest.raises(ValueError):
        Group(transport, segment_bytes=0)
    with pytest.raises(ValueError):
        Group(transport, small_message_bytes=-1)
    with pytest.raises(TypeError):
        Group(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(("n", "size"), [(2, 1), (3, 10), (5, 37), (7, 100)])
async def test_ring_mean_is_the_sum_divided_once(n: int, size: int, dtype: type) -> None:
    """The ring divides each rank's own chunk after its last reduction; the result must
    be bit for bit what dividing the finished sum by n gives, on every rank."""
    rng = np.random.default_rng(n * 1000 + size)
    data = [rng.standard_normal(size).astype(dtype) for _ in range(n)]

    async def body(g: Group) -> tuple[np.ndarray, np.ndarray]:
        total = await g.all_reduce(data[g.rank].copy(), ReduceOp.SUM, timeout=5)
        mean = await g.all_reduce(data[g.rank].copy(), ReduceOp.MEAN, timeout=5)
        return total, mean

    results = await run_ranks(n, body, small_message_bytes=RING, segment_bytes=8)
    expected = np.divide(results[0][0], n)
    for _, mean in results:
        assert mean.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(mean.view(np.uint8), expected.view(np.uint8))
