"""Every ``Group`` collective with torch tensors, at 2 and 3 in-process ranks, with both
algorithm families; bfloat16 and float16 reductions bitwise against torch's own
elementwise arithmetic in the order the algorithm combines; and bfloat16 over TCP in a
process where ml_dtypes (and then torch too) cannot be imported.

Reduction orders (from ``netdist.collectives.plan``), for ``x_r`` rank ``r``'s data:

- recursive doubling (small messages): 2 ranks ``x0 + x1``; 3 ranks ``(x0 + x1) + x2``
  (rank 0 folds into rank 1, which then exchanges with rank 2).
- ring (and ring reduce-scatter): chunk ``c`` of ``chunk_bounds(size, n)`` is reduced
  along the chain ``c+1, c+2, ..., c`` (mod n): 3 ranks ``(x_{c+1} + x_{c+2}) + x_c``.
- binomial-tree reduce to ``dst``: children nearest first, ``(x_dst + x_{dst+1}) + x_{dst+2}``.

``MEAN`` is that sum divided by ``n`` once. One bfloat16/float16 add is commutative, so
only the association matters.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

from netdist.collectives import Group
from netdist.sharding import chunk_bounds
from netdist.types import ReduceOp
from tests.collectives.helpers import RING, SMALL
from tests.ranks import run_ranks

ALGOS = {"small": SMALL, "ring": RING}
SEGMENT = 64  # bytes: several ring segments per chunk
SUBPROCESS_TIMEOUT = 90.0


def ints(rank: int, shape: tuple[int, ...] = (5, 7), dtype: torch.dtype = torch.float64
         ) -> torch.Tensor:
    """Integer-valued data: sums are exact in every dtype used here."""
    rng = np.random.default_rng(100 + rank)
    return torch.from_numpy(rng.integers(-50, 50, shape)).to(dtype)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a transposed (non-contiguous) layout."""
    nc = t.t().contiguous().t()
    assert not nc.is_contiguous() and torch.equal(nc, t)
    return nc


def run(n: int, algo: str, body: Callable) -> list:  # type: ignore[type-arg]
    return run_ranks(n, body, small_message_bytes=ALGOS[algo], segment_bytes=SEGMENT)


# ------------------------------------------------------------------- in-place collectives


@pytest.mark.parametrize("layout", ["contiguous", "non-contiguous"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_tensor_in_place(n: int, algo: str, layout: str) -> None:
    async def body(g: Group) -> torch.Tensor:
        t = ints(g.rank)
        if layout == "non-contiguous":
            t = noncontiguous(t)
        ptr, stride = t.data_ptr(), t.stride()
        result = await g.all_reduce(t, timeout=5)
        assert result is t and t.data_ptr() == ptr and t.stride() == stride
        work = await g.all_reduce(t, ReduceOp.MAX, async_op=True, timeout=5)
        assert (await work) is t
        return t

    results = await run(n, algo, body)
    expected = sum(ints(r) for r in range(n))
    for t in results:
        assert torch.equal(t, expected)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_parameter_gradient_all_reduced_in_place(n: int, algo: str) -> None:
    async def body(g: Group) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(5, 7, dtype=torch.float64))
        (p * ints(g.rank)).sum().backward()
        grad = p.grad
        assert grad is not None
        assert (await g.all_reduce(grad, ReduceOp.MEAN, timeout=5)) is grad
        assert p.grad is grad
        return grad

    results = await run(n, algo, body)
    expected = sum(ints(r) for r in range(n)) / n
    for t in results:
        assert torch.equal(t, expected)


@pytest.mark.parametrize("layout", ["contiguous", "non-contiguous"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_broadcast_tensor_in_place(n: int, algo: str, layout: str) -> None:
    src = n - 1

    async def body(g: Group) -> torch.Tensor:
        t = ints(g.rank, dtype=torch.int32)
        if layout == "non-contiguous":
            t = noncontiguous(t)
        assert (await g.broadcast(t, src, timeout=5)) is t
        return t

    for t in await run(n, algo, body):
        assert torch.equal(t, ints(src, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["contiguous", "non-contiguous"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_reduce_tensor_in_place_on_dst_only(n: int, algo: str, layout: str) -> None:
    dst = 1

    async def body(g: Group) -> torch.Tensor:
        t = ints(g.rank)
        if layout == "non-contiguous":
            t = noncontiguous(t)
        assert (await g.reduce(t, dst, ReduceOp.SUM, timeout=5)) is t
        return t

    results = await run(n, algo, body)
    for r, t in enumerate(results):
        assert torch.equal(t, sum(ints(q) for q in range(n)) if r == dst else ints(r))


# ------------------------------------------------------------------ results as tensors


@pytest.mark.parametrize("out", ["none", "contiguous", "non-contiguous"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_reduce_scatter_tensor(n: int, algo: str, out: str) -> None:
    size = 35

    async def body(g: Group) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = ints(g.rank)  # 5 x 7 = 35 elements
        lo, hi = chunk_bounds(size, n)[g.rank]
        if out == "none":
            result = await g.reduce_scatter(t, timeout=5)
            assert isinstance(result, torch.Tensor) and result.shape == (hi - lo,)
            return result, None
        target = (torch.zeros(hi - lo, dtype=torch.float64) if out == "contiguous"
                  else torch.zeros(hi - lo, 2, dtype=torch.float64)[:, 1])
        assert (await g.reduce_scatter(t, out=target, timeout=5)) is target
        return target, t

    results = await run(n, algo, body)
    full = sum(ints(r) for r in range(n)).reshape(-1)
    for r, (result, original) in enumerate(results):
        lo, hi = chunk_bounds(size, n)[r]
        assert torch.equal(result, full[lo:hi])
        if original is not None:
            assert torch.equal(original, ints(r))  # the input is not modified


@pytest.mark.parametrize("out", ["none", "contiguous", "non-contiguous"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_all_gather_tensor(n: int, algo: str, out: str) -> None:
    rows = 7
    bounds = chunk_bounds(rows, n)

    def shard(rank: int) -> torch.Tensor:
        a, b = bounds[rank]
        return ints(0, (rows, 3), torch.int64)[a:b]

    async def body(g: Group) -> torch.Tensor:
        mine = noncontiguous(shard(0)) if g.rank == 0 else shard(g.rank)
        if out == "none":
            result = await g.all_gather(mine, timeout=5)
            assert isinstance(result, torch.Tensor)
            return result
        target = (torch.zeros(rows, 3, dtype=torch.int64) if out == "contiguous"
                  else torch.zeros(3, rows, dtype=torch.int64).t())
        assert (await g.all_gather(mine, out=target, timeout=5)) is target
        return target

    for result in await run(n, algo, body):
        assert torch.equal(result, ints(0, (rows, 3), torch.int64))


@pytest.mark.parametrize("n", [2, 3])
async def test_gather_returns_tensors_on_dst(n: int) -> None:
    def mine(rank: int) -> torch.Tensor:
        return torch.arange(2.0 * (rank + 1)).reshape(2, rank + 1) + 100 * rank

    async def body(g: Group) -> list[torch.Tensor] | None:
        t = mine(g.rank)
        return await g.gather(noncontiguous(t) if g.rank else t, 0, timeout=5)

    results = await run_ranks(n, body)
    assert all(r is None for r in results[1:])
    gathered = results[0]
    assert [type(t) for t in gathered] == [torch.Tensor] * n
    for r, t in enumerate(gathered):
        assert torch.equal(t, mine(r))


@pytest.mark.parametrize("n", [2, 3])
async def test_scatter_tensors(n: int) -> None:
    src = 1

    def piece(r: int) -> torch.Tensor:
        return torch.arange(4, dtype=torch.float16) + 10 * r

    async def body(g: Group) -> tuple[object, torch.Tensor]:
        arrays = [noncontiguous(piece(r).reshape(2, 2)).reshape(2, 2) for r in range(n)] \
            if g.rank == src else None
        plain = await g.scatter(arrays, src, timeout=5)
        out = torch.zeros(2, 2, dtype=torch.float16).t()  # non-contiguous out=
        arrays = [piece(r).reshape(2, 2) for r in range(n)] if g.rank == src else None
        assert (await g.scatter(arrays, src, out=out, timeout=5)) is out
        return plain, out

    results = await run_ranks(n, body)
    for r, (plain, out) in enumerate(results):
        expected = piece(r).reshape(2, 2)
        if r == src:  # tensors went in here: a tensor comes back
            assert isinstance(plain, torch.Tensor) and torch.equal(plain, expected)
        else:  # nothing went in: NumPy, as ever
            assert isinstance(plain, np.ndarray)
            np.testing.assert_array_equal(plain, expected.numpy())
        assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [2, 3])
async def test_all_to_all_tensors(n: int) -> None:
    def block(i: int, j: int) -> torch.Tensor:
        return torch.tensor([[i * 10 + j, -i, j]], dtype=torch.int64)

    async def body(g: Group) -> list[torch.Tensor]:
        inputs = [block(g.rank, j) for j in range(n)]
        outputs = [torch.zeros(3, 1, dtype=torch.int64).t() if j % 2 else
                   torch.zeros(1, 3, dtype=torch.int64) for j in range(n)]
        result = await g.all_to_all(inputs, outputs, timeout=5)
        assert all(a is b for a, b in zip(result, outputs))
        return outputs

    results = await run_ranks(n, body)
    for i, outputs in enumerate(results):
        for j, t in enumerate(outputs):
            assert torch.equal(t, block(j, i))


async def test_send_recv_tensors() -> None:
    async def body(g: Group) -> object:
        if g.rank == 0:
            t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            await g.send(t, 1, tag=1)
            await g.send(noncontiguous(t), 1, tag=2)
            await g.send(t.to(torch.bfloat16), 1, tag=3)
            return None
        out = torch.zeros(3, 2).t()  # non-contiguous out=
        assert (await g.recv(0, tag=1, out=out, timeout=5)) is out
        plain = await g.recv(0, tag=2, timeout=5)
        bf16 = torch.zeros(2, 3, dtype=torch.bfloat16)
        assert (await g.recv(0, tag=3, out=bf16, timeout=5)) is bf16
        return out, plain, bf16

    _, (out, plain, bf16) = await run_ranks(2, body)
    expected = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(out, expected)
    assert isinstance(plain, np.ndarray)
    np.testing.assert_array_equal(plain, expected.numpy())
    assert torch.equal(bf16, expected.to(torch.bfloat16))


async def test_tensor_off_the_cpu_is_refused_before_anything_is_sent() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(ValueError, match="all_reduce: netdist works on CPU tensors, "
                                             "got one on meta"):
            await g.all_reduce(torch.empty(3, device="meta"), timeout=5)
        with pytest.raises(ValueError, match="recv out=: netdist works on CPU tensors"):
            await g.recv(1 - g.rank, out=torch.empty(3, device="meta"), timeout=5)
        # nothing was sent, so the group is still in step
        t = torch.ones(3)
        await g.all_reduce(t, timeout=5)
        assert torch.equal(t, torch.full((3,), 2.0))

    await run_ranks(2, body)


async def test_overlapping_tensor_is_refused_in_place() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(ValueError, match="overlap in memory"):
            await g.all_reduce(torch.zeros(3).expand(2, 3), timeout=5)
        gathered = await g.all_gather(torch.ones(3).expand(2, 3), timeout=5)  # read only
        assert torch.equal(gathered, torch.ones(4, 3))

    await run_ranks(2, body)


# ------------------------------------------- bfloat16 and float16 bitwise against torch


TORCH_OP = {ReduceOp.SUM: torch.add, ReduceOp.MEAN: torch.add, ReduceOp.PROD: torch.mul,
            ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}
SIZE = 1001


def floats(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spread over a few binades (so rounding happens in every add), small enough
    that products of three stay finite in float16."""
    rng = np.random.default_rng(7 + rank)
    values = rng.standard_normal(SIZE) * 2.0 ** rng.integers(-3, 3, SIZE)
    return torch.from_numpy(values).to(dtype)


def in_order(xs: list[torch.Tensor], order: list[int], op: ReduceOp) -> torch.Tensor:
    """Reduce ``xs`` elementwise in torch, left to right in ``order``."""
    acc = xs[order[0]].clone()
    for r in order[1:]:
        acc = TORCH_OP[op](acc, xs[r])
    if op is ReduceOp.MEAN:
        acc = acc / len(xs)
    return acc


def expected_all_reduce(xs: list[torch.Tensor], op: ReduceOp, algo: str,
                        data_path: str = "tcp") -> torch.Tensor:
    """The ring reduces chunk ``c`` along ``c+1, ..., c``; recursive doubling and the
    shared-memory path reduce lowest rank first."""
    n = len(xs)
    if algo == "small" or n == 2 or data_path == "shm":
        return in_order(xs, list(range(n)), op)
    out = torch.empty_like(xs[0])
    for c, (a, b) in enumerate(chunk_bounds(SIZE, n)):
        chain = [(c + k) % n for k in range(1, n + 1)]  # c+1, c+2, ..., c
        out[a:b] = in_order([x[a:b] for x in xs], chain, op)
    return out


def assert_bitwise(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), \
        f"{int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())} elements differ"


def test_orders_matter_for_this_data() -> None:
    """The reference orders are distinguishable: a wrong order would fail the tests."""
    for dtype in (torch.bfloat16, torch.float16):
        xs = [floats(r, dtype) for r in range(3)]
        assert not torch.equal(in_order(xs, [0, 1, 2], ReduceOp.SUM),
                               in_order(xs, [1, 2, 0], ReduceOp.SUM))


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("op", list(TORCH_OP), ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_all_reduce_matches_torch_bitwise(n: int, algo: str, dtype: str,
                                                op: ReduceOp, data_path: str) -> None:
    dt = DTYPES[dtype]

    async def body(g: Group) -> torch.Tensor:
        t = floats(g.rank, dt)
        assert (await g.all_reduce(t, op, timeout=5)) is t
        return t

    results = await run(n, algo, body)
    expected = expected_all_reduce([floats(r, dt) for r in range(n)], op, algo, data_path)
    for t in results:
        assert_bitwise(t, expected)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3])
async def test_reduce_scatter_matches_torch_bitwise(n: int, algo: str, dtype: str,
                                                    op: ReduceOp, data_path: str) -> None:
    dt = DTYPES[dtype]

    async def body(g: Group) -> torch.Tensor:
        return await g.reduce_scatter(floats(g.rank, dt), op, timeout=5)

    results = await run(n, algo, body)
    expected = expected_all_reduce([floats(r, dt) for r in range(n)], op, algo, data_path)
    for r, t in enumerate(results):
        a, b = chunk_bounds(SIZE, n)[r]
        assert_bitwise(t, expected[a:b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dst", [0, 2])
async def test_reduce_matches_torch_bitwise(dst: int, algo: str, dtype: str) -> None:
    n, dt = 3, DTYPES[dtype]

    async def body(g: Group) -> torch.Tensor:
        t = floats(g.rank, dt)
        await g.reduce(t, dst, ReduceOp.SUM, timeout=5)
        return t

    results = await run(n, algo, body)
    xs = [floats(r, dt) for r in range(n)]
    expected = (in_order(xs, [dst, (dst + 1) % n, (dst + 2) % n], ReduceOp.SUM)
                if algo == "small" else expected_all_reduce(xs, ReduceOp.SUM, algo))
    assert_bitwise(results[dst], expected)


# ------------------------------------------------------ bfloat16 without ml_dtypes, TCP

HIDE_ML_DTYPES = 'import sys\nsys.modules["ml_dtypes"] = None\n'

NO_ML_DTYPES_SCRIPT = HIDE_ML_DTYPES + textwrap.dedent('''
    import asyncio
    import os
    import torch
    from netdist.collectives import Group
    from netdist.sharding import chunk_bounds
    from netdist.transport.local_tcp import local_tcp_group
    from netdist.types import BFLOAT16, BFLOAT16_RAW, WIRE_DTYPES, ReduceOp

    assert "bfloat16" not in WIRE_DTYPES and BFLOAT16 is BFLOAT16_RAW
    N, SIZE = 3, 1001

    def floats(rank):
        g = torch.Generator().manual_seed(rank)
        return (torch.randn(SIZE, generator=g) * 2.0 ** torch.randint(-3, 3, (SIZE,),
                generator=g)).to(torch.bfloat16)

    def bits(t):
        return t.view(torch.int16)

    async def body(g, small):
        x = floats(g.rank)
        summed = x.clone()
        assert await g.all_reduce(summed, timeout=20) is summed
        mean = x.clone()
        await g.all_reduce(mean, ReduceOp.MEAN, timeout=20)
        shard = await g.reduce_scatter(x, timeout=20)
        gathered = await g.all_gather(x[:5], timeout=20)
        b = x.clone()
        await g.broadcast(b, 0, timeout=20)
        if g.rank == 0:
            await g.send(x, 1, tag=4)
            got = None
        elif g.rank == 1:
            got = await g.recv(0, tag=4, timeout=20)  # no out=: a bfloat16 tensor
        else:
            got = None
        return summed, mean, shard, gathered, b, got

    async def main():
        xs = [floats(r) for r in range(N)]
        for small in (1 << 40, 0):
            async with local_tcp_group(N, timeout=20.0) as ts:
                groups = [Group(t, small_message_bytes=small, segment_bytes=256) for t in ts]
                results = await asyncio.gather(*(body(g, small) for g in groups))
                for g in groups:
                    await g.aclose()
            if small or os.environ.get("NETDIST_SHM") != "0":  # lowest rank first
                ref = (xs[0] + xs[1]) + xs[2]
            else:  # the ring's chain order
                ref = torch.empty(SIZE, dtype=torch.bfloat16)
                for c, (a, b) in enumerate(chunk_bounds(SIZE, N)):
                    ref[a:b] = (xs[(c + 1) % N][a:b] + xs[(c + 2) % N][a:b]) + xs[c][a:b]
            for r, (summed, mean, shard, gathered, b, got) in enumerate(results):
                assert summed.dtype is torch.bfloat16
                assert torch.equal(bits(summed), bits(ref)), (small, r)
                assert torch.equal(bits(mean), bits(ref / N)), (small, r)
                lo, hi = chunk_bounds(SIZE, N)[r]
                assert torch.equal(bits(shard), bits(ref[lo:hi])), (small, r)
                assert torch.equal(bits(gathered), bits(torch.cat([x[:5] for x in xs])))
                assert torch.equal(bits(b), bits(xs[0]))
                if r == 1:
                    assert got.dtype is torch.bfloat16 and torch.equal(bits(got), bits(xs[0]))
        print("ok")

    asyncio.run(main())
''')

NEITHER_SCRIPT = HIDE_ML_DTYPES + 'sys.modules["torch"] = None\n' + textwrap.dedent('''
    import asyncio
    import numpy as np
    from netdist.collectives import Group
    from netdist.transport.local_tcp import local_tcp_group
    from netdist.types import BFLOAT16_RAW

    async def main():
        async with local_tcp_group(2, timeout=20.0) as ts:
            g0, g1 = Group(ts[0]), Group(ts[1])
            raw = np.array([0x3F80, 0x4000, 0x7FC0], np.uint16).view(BFLOAT16_RAW)
            await g0.send(raw, 1, tag=1)
            await g0.send(np.arange(3, dtype=np.float32), 1, tag=2)
            try:
                await g1.recv(0, tag=1, timeout=20)
            except TypeError as exc:
                print(exc)
            else:
                raise SystemExit("no error")
            # the frame was read whole: the connection is fine
            follow = await g1.recv(0, tag=2, timeout=20)
            assert follow.tolist() == [0.0, 1.0, 2.0]
            # a NumPy program can still receive it as raw bits, into out=
            await g0.send(raw, 1, tag=3)
            out = np.empty(3, BFLOAT16_RAW)
            await g1.recv(0, tag=3, out=out, timeout=20)
            assert out.view(np.uint16).tolist() == [0x3F80, 0x4000, 0x7FC0]
            await g0.aclose()
            await g1.aclose()

    asyncio.run(main())
''')


def _run_script(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, check=False)


@pytest.mark.slow
def test_bfloat16_collectives_over_tcp_without_ml_dtypes() -> None:
    done = _run_script(NO_ML_DTYPES_SCRIPT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@pytest.mark.slow
def test_bfloat16_received_without_ml_dtypes_or_torch_is_a_clear_error() -> None:
    done = _run_script(NEITHER_SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (
        "recv: received bfloat16 data [3], which NumPy cannot represent without ml_dtypes: "
        "pip install 'netdist[bf16]' (or receive into a torch.bfloat16 tensor with out=)")

