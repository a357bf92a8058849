"""``netdist.tensors`` (NumPy views of torch tensors) and bfloat16 arithmetic in
``netdist.types``, against torch itself.

The bfloat16 tests compare bit patterns: netdist's rounding and reductions must give
exactly what torch's CPU kernels give, for ties, subnormals, infinities, overflow and
NaN, with or without ml_dtypes (the same code runs either way).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from netdist.errors import TensorDeviceError
from netdist.tensors import (
    any_tensor,
    as_array,
    as_arrays,
    is_tensor,
    numpy_result,
    stage_out,
    to_tensor,
)
from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.reduce_kernels import combine, divide_into, reduce_into
from netdist.types import (
    BFLOAT16,
    BFLOAT16_RAW,
    ReduceOp,
    dtype_from_wire,
    dtype_to_wire,
    is_bfloat16,
)

SUBPROCESS_TIMEOUT = 60.0


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw 16-bit patterns of a bfloat16 tensor."""
    return t.view(torch.int16).numpy().view(np.uint16)


def bf16_from_bits(u16: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(u16, np.uint16).view(np.int16)).view(
        torch.bfloat16)


# -------------------------------------------------------------------- tensors as arrays


def test_is_tensor_knows_tensors_and_parameters_only() -> None:
    assert is_tensor(torch.zeros(2))
    assert is_tensor(torch.nn.Parameter(torch.zeros(2)))
    assert not is_tensor(np.zeros(2))
    assert not is_tensor([1.0, 2.0])
    assert any_tensor([np.zeros(1), torch.zeros(1)])
    assert not any_tensor([np.zeros(1), 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.int64, torch.uint8, torch.bool, torch.bfloat16])
def test_as_array_is_a_view_of_the_tensors_memory(dtype: torch.dtype) -> None:
    t = torch.arange(12).reshape(3, 4).to(dtype)
    a = as_array(t, "test")
    assert a.shape == (3, 4)
    assert a.ctypes.data == t.data_ptr()
    assert a.dtype == (BFLOAT16 if dtype is torch.bfloat16 else t.numpy().dtype)
    a[1, 2] = a[0, 1]  # written through the array, seen by the tensor
    assert t[1, 2].item() == t[0, 1].item()


def test_as_array_of_a_parameter_that_requires_grad() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    a = as_array(p, "test")
    a[0] = 5.0
    assert p.detach()[0].item() == 5.0


def test_non_contiguous_tensor_is_a_strided_view() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    a = as_array(t, "test")
    assert not a.flags.c_contiguous
    assert np.shares_memory(a, t.numpy())
    np.testing.assert_array_equal(a, t.numpy())


def test_tensor_off_the_cpu_is_a_clear_error() -> None:
    t = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"all_reduce: netdist works on CPU tensors, got one "
                                         r"on meta; move it with \.cpu\(\)"):
        as_array(t, "all_reduce")


def test_sparse_tensor_is_a_clear_error() -> None:
    t = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match="needs a dense tensor, got layout torch.sparse_coo"):
        as_array(t, "x")


def test_every_refusal_of_an_off_cpu_or_sparse_tensor_is_one_error_type() -> None:
    """The collectives' view, the torch backend's check and a checkpoint's view are one
    conversion: each refuses the tensor with ``TensorDeviceError`` (the ``ValueError``
    the collectives document), in its own words."""
    from netdist.checkpoint.torch_state import tensor_array
    from netdist.torch.array_views import check_cpu

    refusals = {
        "collectives": lambda t: as_array(t, "all_reduce"),
        "backend": lambda t: check_cpu(t, "allreduce"),
        "checkpoint": lambda t: tensor_array(t, "w"),
    }
    for where, refuse in refusals.items():
        for tensor, says in ((torch.empty(3, device="meta"), "meta"),
                             (torch.eye(3).to_sparse(), "sparse_coo")):
            with pytest.raises(TensorDeviceError, match=says) as caught:
                refuse(tensor)
            assert isinstance(caught.value, ValueError), where
    with pytest.raises(TensorDeviceError, match=r"netdist backend works on CPU tensors, "
                                                "got one on meta; use a 'cpu:netdist"):
        check_cpu(torch.empty(3, device="meta"), "allreduce")


def test_overlapping_tensor_cannot_be_written() -> None:
    t = torch.zeros(3).expand(4, 3)
    assert as_array(t, "read").shape == (4, 3)  # reading is fine
    with pytest.raises(ValueError, match=r"elements overlap in memory .*strides \(0, 1\)"):
        as_array(t, "write", writeable=True)


def test_not_a_tensor_names_what_was_given() -> None:
    with pytest.raises(TypeError, match="x needs a numpy.ndarray or a CPU torch.Tensor, got list"):
        as_array([1, 2], "x")


def test_as_arrays_passes_arrays_through() -> None:
    a = np.zeros(2)
    t = torch.ones(2)
    out = as_arrays([a, t], "x")
    assert out[0] is a and out[1].ctypes.data == t.data_ptr()


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.bool_])
def test_to_tensor_shares_memory(dtype: type) -> None:
    a = np.arange(6).astype(dtype)
    t = to_tensor(a)
    assert t.data_ptr() == a.ctypes.data
    np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("dt", [BFLOAT16, BFLOAT16_RAW], ids=["BFLOAT16", "RAW"])
def test_bfloat16_round_trips_bitwise(dt: np.dtype) -> None:
    t = torch.tensor([1.5, -0.0, float("inf"), 3e-39, float("nan")], dtype=torch.bfloat16)
    a = t.view(torch.int16).numpy().view(dt)
    back = to_tensor(a)
    assert back.dtype is torch.bfloat16 and back.data_ptr() == t.data_ptr()
    assert bits(back).tolist() == bits(t).tolist()
    assert is_bfloat16(a.dtype)


def test_stage_out_of_contiguous_tensor_is_not_copied() -> None:
    t = torch.zeros(2, 3)
    staged = stage_out(t, "out=")
    assert not staged.copied and staged.array.ctypes.data == t.data_ptr()
    staged.array[...] = 7
    assert staged.finish() is t and bool((t == 7).all())


def test_stage_out_of_non_contiguous_tensor_copies_back() -> None:
    base = torch.zeros(4, 3)
    t = base.t()  # (3, 4), non-contiguous
    staged = stage_out(t, "out=")
    assert staged.copied and staged.array.flags.c_contiguous
    assert not np.shares_memory(staged.array, base.numpy())
    staged.array[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert bool((t == 0).all())  # nothing written until finish
    assert staged.finish() is t
    np.testing.assert_array_equal(t.numpy(), np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(base.numpy(), np.arange(12).reshape(3, 4).T)


def test_numpy_result_passes_arrays_and_wraps_raw_bfloat16() -> None:
    a = np.arange(3.0)
    assert numpy_result(a, "recv") is a
    raw = np.array([0x3F80, 0x4000], np.uint16).view(BFLOAT16_RAW)
    t = numpy_result(raw, "recv")  # torch is imported here: a bfloat16 tensor
    assert t.dtype is torch.bfloat16 and t.tolist() == [1.0, 2.0]


def test_wire_names_of_bfloat16() -> None:
    assert dtype_to_wire(BFLOAT16_RAW) == "bfloat16"
    assert dtype_to_wire(BFLOAT16) == "bfloat16"
    assert dtype_to_wire("bfloat16") == "bfloat16"
    assert dtype_from_wire("bfloat16") == BFLOAT16
    assert not is_bfloat16(np.dtype(np.uint16))
    assert not is_bfloat16(np.dtype("V2"))


# ------------------------------------------------------- bfloat16 arithmetic against torch

# float32 bit patterns around every rounding edge
EDGE_F32_BITS = np.array([
    0x00000000, 0x80000000,              # +-0
    0x3F800000, 0x3F808000, 0x3F818000,  # 1, a tie rounding down to even, a tie rounding up
    0x3F808001, 0x3F807FFF,              # just above / below the tie
    0x00000001, 0x00008000, 0x00018000,  # subnormals: smallest, ties to even (0 and 2)
    0x00007FFF, 0x007FFFFF, 0x00800000,  # below a tie, largest subnormal, smallest normal
    0x807FFFFF, 0x80008000,
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000,  # bfloat16 max, below and at the overflow tie
    0x7F7FFFFF, 0xFF7FFFFF,              # float32 max: overflows bfloat16 to +-inf
    0x7F800000, 0xFF800000,              # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF,  # NaNs (quiet, negative, signalling)
    0x40490FDB, 0xC2F6E979,              # pi, -123.456
], dtype=np.uint32)


def test_float32_to_bfloat16_rounds_exactly_as_torch() -> None:
    f = EDGE_F32_BITS.view(np.float32)
    ours = float32_to_bfloat16(f)
    theirs = torch.from_numpy(f.copy()).to(torch.bfloat16)
    nan = np.isnan(f)
    assert ours.view(np.uint16)[~nan].tolist() == bits(theirs)[~nan].tolist()
    assert np.isnan(bfloat16_to_float32(ours)[nan]).all()  # NaN stays NaN
    assert (ours.view(np.uint16)[nan] == 0x7FC0).all()   # one quiet NaN (see below)


def test_float32_to_bfloat16_matches_torch_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(0)
    f = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ours = float32_to_bfloat16(f).view(np.uint16)
    theirs = bits(torch.from_numpy(f.copy()).to(torch.bfloat16))
    nan = np.isnan(f)
    assert np.array_equal(ours[~nan], theirs[~nan])


def test_bfloat16_to_float32_is_exact() -> None:
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = bfloat16_to_float32(every.view(BFLOAT16_RAW)).view(np.uint32)
    theirs = bf16_from_bits(every).float().numpy().view(np.uint32)
    nan = np.isnan(ours.view(np.float32))
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(theirs.view(np.float32)[nan]).all()


def _edge_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every pair of bfloat16 edge values (ties, subnormals, max, inf, NaN, zeros)."""
    edge = float32_to_bfloat16(EDGE_F32_BITS.view(np.float32)).view(np.uint16)
    edge = np.unique(np.concatenate([edge, [0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x3F81, 0x0080]]
                                    ).astype(np.uint16))
    a, b = np.meshgrid(edge, edge, indexing="ij")
    return a.ravel(), b.ravel()


TORCH_OPS = {ReduceOp.SUM: torch.add, ReduceOp.PROD: torch.mul,
             ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


@pytest.mark.parametrize("dt", [BFLOAT16, BFLOAT16_RAW], ids=["BFLOAT16", "RAW"])
@pytest.mark.parametrize("op", list(TORCH_OPS), ids=lambda op: op.name)
def test_bfloat16_combine_matches_torch_bitwise_on_edge_cases(op: ReduceOp,
                                                              dt: np.dtype) -> None:
    a, b = _edge_pairs()
    rng = np.random.default_rng(1)
    ra = rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16)
    rb = rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16)
    a, b = np.concatenate([a, ra]), np.concatenate([b, rb])
    out = np.empty(a.size, dt)
    combine(op, a.view(dt), b.view(dt), out)
    expected = TORCH_OPS[op](bf16_from_bits(a), bf16_from_bits(b))
    assert_same_bfloat16(out, expected)
    acc = a.copy().view(dt)
    reduce_into(op, acc, b.view(dt))
    assert_same_bfloat16(acc, expected)


def assert_same_bfloat16(ours: np.ndarray, theirs: torch.Tensor) -> None:
    """Bitwise equal, except that a NaN only has to be a NaN: torch's NaN bits depend on
    the kernel (its scalar path gives 0x7FC0, its vectorised path 0xFFFF)."""
    nan = torch.isnan(theirs).numpy()
    assert np.array_equal(np.isnan(bfloat16_to_float32(ours)), nan)
    assert np.array_equal(ours.view(np.uint16)[~nan], bits(theirs)[~nan])


@pytest.mark.parametrize("dt", [BFLOAT16, BFLOAT16_RAW], ids=["BFLOAT16", "RAW"])
@pytest.mark.parametrize("n", [2, 3, 7])
def test_bfloat16_divide_matches_torch(n: int, dt: np.dtype) -> None:
    a, _ = _edge_pairs()
    rng = np.random.default_rng(2)
    a = np.concatenate([a, rng.integers(0, 2**16, 50_000, dtype=np.uint32).astype(np.uint16)])
    ours = a.copy().view(dt)
    divide_into(ours, n)
    assert_same_bfloat16(ours, bf16_from_bits(a) / n)


@pytest.mark.parametrize("dt", [BFLOAT16, BFLOAT16_RAW], ids=["BFLOAT16", "RAW"])
def test_bfloat16_kernels_on_strided_arrays(dt: np.dtype) -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**16, (40, 30), dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 2**16, (40, 30), dtype=np.uint32).astype(np.uint16)
    acc = a.copy().view(dt).T  # non-contiguous, written in place
    reduce_into(ReduceOp.SUM, acc, b.view(dt).T)
    assert_same_bfloat16(np.ascontiguousarray(acc),
                         (bf16_from_bits(a) + bf16_from_bits(b)).T.contiguous())
    divide_into(acc, 3)
    assert_same_bfloat16(np.ascontiguousarray(acc),
                         ((bf16_from_bits(a) + bf16_from_bits(b)) / 3).T.contiguous())
    out = np.zeros((30, 40), dt)[:, ::2]
    with pytest.raises(ValueError, match="must have the shape of the values"):
        float32_to_bfloat16(np.zeros(600, np.float32), out=out)


def test_bfloat16_overflow_and_invalid_raise_no_warning() -> None:
    big = np.array([0x7F7F, 0x7F80], np.uint16).view(BFLOAT16_RAW)  # max, +inf
    neg = np.array([0x7F7F, 0xFF80], np.uint16).view(BFLOAT16_RAW)  # max, -inf
    out = np.empty(2, BFLOAT16_RAW)
    combine(ReduceOp.SUM, big, neg, out)  # max + max overflows, inf - inf is NaN
    assert out.view(np.uint16).tolist() == [0x7F80, 0x7FC0]


# ---------------------------------------------------------------- torch stays optional

def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT, check=False)


def test_importing_netdist_never_imports_torch() -> None:
    done = _run("""
        import sys
        import numpy as np
        import netdist
        import netdist.collectives, netdist.compression, netdist.parallel, netdist.ps
        import netdist.tensors, netdist.types, netdist.wire, netdist.transport
        for name in netdist.__all__:
            getattr(netdist, name)
        from netdist.tensors import is_tensor, numpy_result
        assert not is_tensor(np.zeros(1))
        assert numpy_result(np.zeros(1), "x").shape == (1,)
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("torch modules:", loaded)
        assert not loaded, loaded
    """)
    assert done.returncode == 0, done.stdout + done.stderr


def test_raw_bfloat16_for_numpy_without_torch_or_ml_dtypes_is_a_clear_error() -> None:
    done = _run("""
        import sys
        sys.modules["ml_dtypes"] = None
        sys.modules["torch"] = None
        import numpy as np
        from netdist.tensors import numpy_result
        from netdist.types import BFLOAT16, BFLOAT16_RAW, WIRE_DTYPES, dtype_from_wire
        assert "bfloat16" not in WIRE_DTYPES and BFLOAT16 is BFLOAT16_RAW
        assert dtype_from_wire("bfloat16") is BFLOAT16_RAW
        raw = np.zeros(3, BFLOAT16_RAW)
        try:
            numpy_result(raw, "recv")
        except TypeError as exc:
            print(exc)
        else:
            raise SystemExit("no error")
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (
        "recv: received bfloat16 data [3], which NumPy cannot represent without ml_dtypes: "
        "pip install 'netdist[bf16]' (or receive into a torch.bfloat16 tensor with out=)")
