"""``netdist.errors`` (the exception tree) and ``netdist.types`` (dtypes, reductions)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from netdist import errors
from netdist.errors import (
    AuthenticationError,
    BlockingCallError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CollectiveError,
    ConfigError,
    ConnectError,
    DivergenceError,
    ElasticError,
    FSDPError,
    LocalProtocolError,
    NetdistError,
    NetdistTimeoutError,
    CollectiveMismatchError,
    NotInGroupError,
    ObjectEncodeError,
    ParameterServerError,
    PeerLostError,
    PipelineError,
    ProtocolError,
    QuantizationError,
    QuorumLostError,
    RemoteProtocolError,
    RendezvousError,
    RendezvousTimeoutError,
    SharedMemoryError,
    StateTransferError,
    TensorDeviceError,
    TraceError,
    TransportClosedError,
    TransportError,
    UndeliveredError,
)
from netdist.reduce_kernels import divide_into, reduce_into
from netdist.types import (
    WIRE_DTYPES,
    ReduceOp,
    check_reduce_dtype,
    dtype_from_wire,
    dtype_to_wire,
)

# --------------------------------------------------------------------------- errors

TREE = {
    ConfigError: (NetdistError, ValueError),
    ProtocolError: (NetdistError,),
    LocalProtocolError: (ProtocolError,),
    RemoteProtocolError: (ProtocolError,),
    TransportError: (NetdistError,),
    ConnectError: (TransportError,),
    AuthenticationError: (ConnectError, TransportError),
    PeerLostError: (TransportError,),
    TransportClosedError: (TransportError,),
    UndeliveredError: (TransportError,),
    SharedMemoryError: (TransportError,),
    NetdistTimeoutError: (NetdistError, TimeoutError, OSError),
    RendezvousTimeoutError: (NetdistTimeoutError, TimeoutError),
    RendezvousError: (NetdistError,),
    CollectiveError: (NetdistError,),
    CollectiveMismatchError: (CollectiveError, ValueError),
    NotInGroupError: (CollectiveError,),
    ObjectEncodeError: (CollectiveError, TypeError),
    TensorDeviceError: (NetdistError, ValueError),
    BlockingCallError: (NetdistError, RuntimeError),
    ParameterServerError: (NetdistError,),
    FSDPError: (NetdistError, RuntimeError),
    PipelineError: (NetdistError,),
    TraceError: (NetdistError, ValueError),
    QuantizationError: (NetdistError, ValueError),
    ElasticError: (NetdistError,),
    QuorumLostError: (ElasticError,),
    StateTransferError: (ElasticError,),
    DivergenceError: (ElasticError,),
    CheckpointError: (NetdistError,),
    CheckpointNotFoundError: (CheckpointError, FileNotFoundError),
    CheckpointCorruptError: (CheckpointError,),
    CheckpointVersionError: (CheckpointError,),
    CheckpointMismatchError: (CheckpointError,),
}


@pytest.mark.parametrize(("exc", "bases"), list(TREE.items()), ids=lambda x: getattr(x, "__name__", ""))
def test_exception_tree(exc: type[Exception], bases: tuple[type[BaseException], ...]) -> None:
    assert issubclass(exc, NetdistError)
    for base in bases:
        assert issubclass(exc, base), f"{exc.__name__} should subclass {base.__name__}"


def test_every_exported_name_is_in_the_tree() -> None:
    exported = {getattr(errors, name) for name in errors.__all__}
    assert exported == set(TREE) | {NetdistError}
    defined = {obj for _, obj in inspect.getmembers(errors, inspect.isclass)
               if obj.__module__ == errors.__name__}
    assert defined == exported


def test_the_tree_does_not_mix_branches() -> None:
    assert not issubclass(NetdistTimeoutError, TransportError)
    assert not issubclass(PeerLostError, NetdistTimeoutError)
    assert not issubclass(ConfigError, ProtocolError)
    assert not issubclass(RemoteProtocolError, TransportError)
    assert issubclass(NetdistError, Exception) and not issubclass(NetdistError, ValueError)


def test_timeout_is_caught_as_builtin_timeout_error() -> None:
    with pytest.raises(TimeoutError, match="recv from rank 1"):
        raise NetdistTimeoutError("recv from rank 1 (tag 3) timed out after 2.0 s")


def test_config_error_is_caught_as_value_error() -> None:
    with pytest.raises(ValueError, match="bad"):
        raise ConfigError("bad")


def test_peer_lost_error_names_the_rank() -> None:
    exc = PeerLostError(3)
    assert exc.rank == 3
    assert str(exc) == "lost connection to rank 3"
    custom = PeerLostError(5, "rank 5 closed the connection after 10 of 40 payload bytes")
    assert custom.rank == 5
    assert str(custom) == "rank 5 closed the connection after 10 of 40 payload bytes"


def test_rendezvous_timeout_lists_missing_ranks() -> None:
    exc = RendezvousTimeoutError("ranks 2, 3 never arrived after 30 s", missing=(2, 3))
    assert exc.missing == (2, 3)
    assert str(exc) == "ranks 2, 3 never arrived after 30 s"
    assert RendezvousTimeoutError("x").missing == ()


# --------------------------------------------------------------------------- dtypes

BASE_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64", "float16", "float32", "float64"]


def test_wire_dtype_table() -> None:
    extra = {"bfloat16"} if "bfloat16" in WIRE_DTYPES else set()
    assert set(WIRE_DTYPES) == set(BASE_NAMES) | extra
    for name, dt in WIRE_DTYPES.items():
        assert dt.name == name
        assert dt.byteorder in ("<", "=", "|")
        assert dt.newbyteorder("<") == dt  # little-endian


@pytest.mark.parametrize("name", BASE_NAMES)
def test_dtype_round_trip(name: str) -> None:
    dt = np.dtype(name)
    assert dtype_to_wire(dt) == name
    assert dtype_to_wire(name) == name
    assert dtype_to_wire(dt.type) == name
    assert dtype_from_wire(name) == dt.newbyteorder("<")


@pytest.mark.parametrize("name", [n for n in BASE_NAMES if np.dtype(n).itemsize > 1])
def test_big_endian_dtypes_map_to_the_same_wire_name(name: str) -> None:
    big = np.dtype(name).newbyteorder(">")
    assert big.byteorder == ">"
    assert dtype_to_wire(big) == name
    assert dtype_from_wire(dtype_to_wire(big)).byteorder in ("<", "=")


def test_bfloat16_when_ml_dtypes_is_installed() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_to_wire(ml_dtypes.bfloat16) == "bfloat16"
    assert dtype_from_wire("bfloat16") == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.object_, "U4", "S3",
                                   "datetime64[ns]", "timedelta64[s]", np.longdouble,
                                   [("a", "<f4"), ("b", "<i4")]])
def test_unsupported_dtype_is_a_type_error(dtype: object) -> None:
    if np.dtype(dtype).name in WIRE_DTYPES:  # longdouble is float64 on some platforms
        pytest.skip(f"{np.dtype(dtype)} is float64 here")
    with pytest.raises(TypeError, match="is not supported on the wire"):
        dtype_to_wire(dtype)  # type: ignore[arg-type]


def test_unknown_wire_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        dtype_from_wire("complex64")


# --------------------------------------------------------------------------- reductions

A = np.array([1.0, -2.0, 3.0, 0.5])
B = np.array([4.0, 5.0, -6.0, 0.5])


@pytest.mark.parametrize(("op", "expected"), [
    (ReduceOp.SUM, [5.0, 3.0, -3.0, 1.0]),
    (ReduceOp.MEAN, [5.0, 3.0, -3.0, 1.0]),  # sums; the caller divides once at the end
    (ReduceOp.MAX, [4.0, 5.0, 3.0, 0.5]),
    (ReduceOp.MIN, [1.0, -2.0, -6.0, 0.5]),
    (ReduceOp.PROD, [4.0, -10.0, -18.0, 0.25]),
])
def test_reduce_into_each_op(op: ReduceOp, expected: list[float]) -> None:
    acc = A.copy()
    identity = id(acc)
    reduce_into(op, acc, B)
    assert id(acc) == identity
    np.testing.assert_array_equal(acc, expected)
    np.testing.assert_array_equal(B, [4.0, 5.0, -6.0, 0.5])  # incoming untouched


def test_reduce_into_covers_every_op() -> None:
    for op in ReduceOp:
        acc = np.ones(3, dtype=np.int32)
        reduce_into(op, acc, np.full(3, 2, dtype=np.int32))
        assert acc.dtype == np.int32


@pytest.mark.parametrize(("op", "expected"), [
    (ReduceOp.SUM, [True, True, True, False]),
    (ReduceOp.MEAN, [True, True, True, False]),
    (ReduceOp.MAX, [True, True, True, False]),
    (ReduceOp.MIN, [True, False, False, False]),
    (ReduceOp.PROD, [True, False, False, False]),
])
def test_reduce_into_bool_is_logical(op: ReduceOp, expected: list[bool]) -> None:
    acc = np.array([True, True, False, False])
    reduce_into(op, acc, np.array([True, False, True, False]))
    assert acc.dtype == np.bool_
    assert acc.tolist() == expected


def test_reduce_into_integer_overflow_wraps_like_numpy() -> None:
    acc = np.array([127, -128], dtype=np.int8)
    reduce_into(ReduceOp.SUM, acc, np.array([1, -1], dtype=np.int8))
    assert acc.tolist() == [-128, 127]


def test_reduce_into_multidimensional_in_place() -> None:
    acc = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = acc[:]
    reduce_into(ReduceOp.MAX, acc, np.full((2, 3), 2.5, dtype=np.float32))
    np.testing.assert_array_equal(view, [[2.5, 2.5, 2.5], [3, 4, 5]])


INTEGER_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def _c_quotient(x: int, n: int) -> int:
    """C's integer division (truncation toward zero), in Python's unbounded integers."""
    return -(-x // n) if x < 0 else x // n


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 127, 128, 200, 255, 256, 1000])
def test_divide_into_integers_truncates_toward_zero(dtype: str, divisor: int) -> None:
    """MEAN's division on integers is C's (NCCL's ncclAvg): -7 / 2 = -3 where NumPy's
    ``//`` floors to -4; the most negative value divides without overflow; a divisor the
    type cannot hold (int8 over 200 ranks) still gives the exact quotient."""
    info = np.iinfo(dtype)
    values = sorted({v for v in (info.min, info.min + 1, -7, -6, -1, 0, 1, 6, 7,
                                 info.max - 1, info.max) if info.min <= v <= info.max})
    array = np.array(values, dtype)
    divide_into(array, divisor)
    assert array.dtype == np.dtype(dtype)
    assert array.tolist() == [_c_quotient(v, divisor) for v in values]


def test_divide_into_integers_in_place_through_a_strided_view() -> None:
    base = np.arange(-12, 12, dtype=np.int16)
    divide_into(base[::5], 4)  # -12, -7, -2, 3, 8 -> -3, -1, 0, 0, 2
    assert base[::5].tolist() == [-3, -1, 0, 0, 2]
    untouched = np.delete(np.arange(-12, 12), np.arange(0, 24, 5))
    assert np.delete(base, np.arange(0, 24, 5)).tolist() == untouched.tolist()


def test_divide_into_floats_is_one_true_division() -> None:
    array = np.array([-7.0, 1.0, 3.0], np.float32)
    divide_into(array, 2)
    assert array.tolist() == [-3.5, 0.5, 1.5]


def test_check_reduce_dtype_mean_takes_numbers_and_refuses_bool() -> None:
    for name in [*INTEGER_DTYPES, "float16", "float32", "float64"]:
        check_reduce_dtype(ReduceOp.MEAN, np.dtype(name), "all_reduce")
    with pytest.raises(TypeError, match=r"^all_reduce MEAN needs a floating or integer "
                                        r"dtype, got bool"):
        check_reduce_dtype(ReduceOp.MEAN, np.dtype(bool), "all_reduce")
    # the caller's own name for the op (torch's AVG) is the one the message says
    with pytest.raises(TypeError, match=r"^allreduce AVG needs a floating or integer "
                                        r"dtype, got bool"):
        check_reduce_dtype(ReduceOp.MEAN, np.dtype(bool), "allreduce", name="AVG")
    with pytest.raises(TypeError, match=r"^reduce BXOR needs an integer or bool dtype, "
                                        r"got float32"):
        check_reduce_dtype(ReduceOp.BXOR, np.dtype("float32"), "reduce")


def test_reduce_op_values() -> None:
    assert [op.value for op in ReduceOp] == ["sum", "mean", "max", "min", "prod",
                                             "band", "bor", "bxor"]
    assert ReduceOp("max") is ReduceOp.MAX
