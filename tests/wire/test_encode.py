"""Encoder: golden bytes, zero-copy payloads, normalisation and local errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from netdist.config import WireLimits
from netdist.errors import LocalProtocolError
from netdist.wire import (
    MAGIC,
    MAX_TAG,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    FrameKind,
    as_wire_array,
    encode_control,
    encode_data,
    encode_prefix,
    payload_view,
)

from .helpers import frame_bytes

# ---------------------------------------------------------------------------------------
# golden bytes: these pin the format of docs/PROTOCOL.md; if one fails the format drifted


def test_golden_data_frame_float32_tag7() -> None:
    parts = encode_data(np.array([1.0, 2.0], dtype=np.float32), tag=7)
    expected = bytes.fromhex(
        "4e44"                # magic "ND"
        "01"                  # version 1
        "00"                  # kind DATA
        "1c000000"            # H = 28
        "0800000000000000"    # P = 8
        # header: {"tag": 7, "dtype": "float32", "shape": [2]}
        "83"
        "a3746167" "07"
        "a56474797065" "a7666c6f61743332"
        "a57368617065" "9102"
        # payload: 1.0f, 2.0f little-endian
        "0000803f" "00000040"
    )
    assert frame_bytes(parts) == expected
    assert len(parts) == 2
    assert bytes(parts[0]) == expected[:16 + 28]


def test_golden_control_frames() -> None:
    assert encode_control(FrameKind.HEARTBEAT) == bytes.fromhex(
        "4e44" "01" "06" "00000000" "0000000000000000")
    assert encode_control(FrameKind.BYE, {}) == bytes.fromhex(
        "4e44" "01" "07" "00000000" "0000000000000000")
    assert encode_control(FrameKind.ERROR, {"reason": "x"}) == bytes.fromhex(
        "4e44" "01" "05" "0a000000" "0000000000000000"
        "81" "a6726561736f6e" "a178")


def test_golden_empty_and_scalar_frames() -> None:
    empty = encode_data(np.zeros((0, 3), dtype=np.int16), tag=0)
    assert len(empty) == 1  # no payload buffer when P == 0
    header = msgpack.packb({"tag": 0, "dtype": "int16", "shape": [0, 3]})
    assert empty[0] == b"ND\x01\x00" + len(header).to_bytes(4, "little") + bytes(8) + header
    scalar = frame_bytes(encode_data(np.float64(0.5), tag=MAX_TAG))
    header = msgpack.packb({"tag": 2**63 - 1, "dtype": "float64", "shape": []})
    assert header[:6] == b"\x83\xa3tag\xcf"  # uint64 encoding of the tag
    assert scalar == (b"ND\x01\x00" + len(header).to_bytes(4, "little")
                      + (8).to_bytes(8, "little") + header + np.float64(0.5).tobytes())


def test_prefix_constants() -> None:
    assert MAGIC == b"ND" and PROTOCOL_VERSION == 1 and PREFIX_SIZE == 16
    assert encode_prefix(FrameKind.DATA, 5, 2**64 - 1) == (
        b"ND\x01\x00" + b"\x05\x00\x00\x00" + b"\xff" * 8)
    assert [int(kind) for kind in FrameKind] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [kind.name for kind in FrameKind] == [
        "DATA", "HELLO", "CHALLENGE", "AUTH", "OK", "ERROR", "HEARTBEAT", "BYE"]


# ---------------------------------------------------------------------------------------
# zero copy and normalisation


def _address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_payload_is_the_arrays_own_memory() -> None:
    array = np.arange(1000, dtype=np.float64).reshape(10, 100)
    head, payload = encode_data(array, tag=1)
    assert isinstance(payload, memoryview)
    assert payload.format == "B" and payload.ndim == 1 and payload.nbytes == array.nbytes
    assert _address(payload) == array.ctypes.data
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), array)
    array[0, 0] = 42.0  # the frame sees later writes: nothing was copied
    assert np.frombuffer(payload, dtype=np.float64)[0] == 42.0


def test_bytes_like_payloads_are_not_copied() -> None:
    raw = bytearray(b"hello world")
    _, payload = encode_data(raw, tag=3)
    raw[0] = ord("J")
    assert bytes(payload) == b"Jello world"
    _, payload = encode_data(memoryview(raw)[6:], tag=3)
    assert bytes(payload) == b"world"
    assert _address(payload) == _address(memoryview(raw)[6:])


def test_bfloat16_payload_is_not_copied() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    array = np.arange(6, dtype=ml_dtypes.bfloat16)
    head, payload = encode_data(array, tag=0)
    assert b"bfloat16" in head
    assert _address(payload) == array.ctypes.data


def test_big_endian_input_is_normalised() -> None:
    big = np.arange(4, dtype=">i4")
    array = as_wire_array(big)
    assert array.dtype == np.dtype("<i4") and array.tobytes() == np.arange(4, dtype="<i4").tobytes()
    head, payload = encode_data(big, tag=2)
    assert b"int32" in head
    assert bytes(payload) == bytes.fromhex("00000000" "01000000" "02000000" "03000000")
    assert not np.shares_memory(np.frombuffer(payload, np.uint8), big)


def test_non_contiguous_input_is_normalised() -> None:
    base = np.arange(20, dtype=np.float32).reshape(4, 5)
    view = base[:, 1::2]
    head, payload = encode_data(view, tag=0)
    assert np.frombuffer(payload, dtype=np.float32).tolist() == view.ravel().tolist()
    assert msgpack.unpackb(head[16:])["shape"] == [4, 2]
    fortran = np.asfortranarray(base)
    _, payload = encode_data(fortran, tag=0)
    assert bytes(payload) == base.tobytes()


def test_non_contiguous_memoryview_is_copied_once() -> None:
    raw = bytes(range(10))
    _, payload = encode_data(memoryview(raw)[::2], tag=0)
    assert bytes(payload) == bytes([0, 2, 4, 6, 8])


def test_payload_view_of_zero_d_and_bool() -> None:
    assert bytes(payload_view(np.array(True))) == b"\x01"
    assert bytes(payload_view(np.array([True, False]))) == b"\x01\x00"
    with pytest.raises(LocalProtocolError, match="C-contiguous"):
        payload_view(np.arange(4)[::2])


def test_lists_and_scalars_go_through_asarray() -> None:
    head, payload = encode_data([1, 2, 3], tag=0)
    assert msgpack.unpackb(head[16:]) == {"tag": 0, "dtype": "int64", "shape": [3]}
    head, payload = encode_data(1.5, tag=0)
    assert msgpack.unpackb(head[16:]) == {"tag": 0, "dtype": "float64", "shape": []}
    assert bytes(payload) == np.float64(1.5).tobytes()


def test_subclass_is_sent_as_plain_array() -> None:
    masked = np.ma.MaskedArray(np.arange(3, dtype=np.int8), mask=[0, 1, 0])
    _, payload = encode_data(masked, tag=0)
    assert bytes(payload) == b"\x00\x01\x02"


# ---------------------------------------------------------------------------------------
# local errors


@pytest.mark.parametrize("value", [
    np.zeros(2, dtype=np.complex64),
    np.array(["a", "b"]),
    np.array([object()], dtype=object),
    np.zeros(2, dtype=[("a", "<i4")]),
    np.zeros(2, dtype="datetime64[s]"),
])
def test_unsupported_dtypes_are_refused(value: np.ndarray) -> None:
    with pytest.raises(LocalProtocolError, match="cannot be sent"):
        encode_data(value, tag=0)


@pytest.mark.parametrize("tag", [-1, 2**63, True, 1.0, "1", None])
def test_bad_tags_are_refused(tag: object) -> None:
    with pytest.raises(LocalProtocolError, match="tag"):
        encode_data(b"x", tag=tag)  # type: ignore[arg-type]


def test_numpy_integer_tag_is_accepted() -> None:
    head, _ = encode_data(b"x", tag=np.int64(5))  # type: ignore[arg-type]
    assert msgpack.unpackb(head[16:])["tag"] == 5


def test_encode_limits_at_edge_and_one_past() -> None:
    array = np.zeros((1,) * 30, dtype=np.float32)
    head, _ = encode_data(array, tag=MAX_TAG)
    hlen = len(head) - PREFIX_SIZE
    assert hlen >= 65
    encode_data(array, tag=MAX_TAG, limits=WireLimits(max_header_bytes=hlen))
    with pytest.raises(LocalProtocolError, match=f"header of {hlen} bytes exceeds "
                                                 f"max_header_bytes {hlen - 1}"):
        encode_data(array, tag=MAX_TAG, limits=WireLimits(max_header_bytes=hlen - 1))

    data = np.zeros(100, dtype=np.uint8)
    encode_data(data, tag=0, limits=WireLimits(max_payload_bytes=100))
    with pytest.raises(LocalProtocolError, match="payload of 100 bytes exceeds max_payload_bytes 99"):
        encode_data(data, tag=0, limits=WireLimits(max_payload_bytes=99))

    cube = np.zeros((2, 2, 2))
    encode_data(cube, tag=0, limits=WireLimits(max_ndim=3))
    with pytest.raises(LocalProtocolError, match="3 dimensions, more than max_ndim 2"):
        encode_data(cube, tag=0, limits=WireLimits(max_ndim=2))

    only32 = WireLimits(allowed_dtypes=frozenset({"float32"}))
    encode_data(np.zeros(2, np.float32), tag=0, limits=only32)
    with pytest.raises(LocalProtocolError, match="dtype float64 is not allowed"):
        encode_data(np.zeros(2), tag=0, limits=only32)


def test_encode_control_errors() -> None:
    with pytest.raises(LocalProtocolError, match="DATA"):
        encode_control(FrameKind.DATA, {})
    with pytest.raises(LocalProtocolError, match="unknown frame kind"):
        encode_control(42)
    with pytest.raises(LocalProtocolError, match="non-string map key"):
        encode_control(FrameKind.HELLO, {1: 2})  # type: ignore[dict-item]
    with pytest.raises(LocalProtocolError, match="value of type"):
        encode_control(FrameKind.HELLO, {"x": msgpack.ExtType(1, b"")})
    with pytest.raises(LocalProtocolError, match="value of type"):
        encode_control(FrameKind.HELLO, {"x": {1, 2}})
    with pytest.raises(LocalProtocolError, match="must be a dict"):
        encode_control(FrameKind.HELLO, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="cannot encode"):
        encode_control(FrameKind.HELLO, {"x": 2**64})
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(LocalProtocolError, match="nested or cyclic"):
        encode_control(FrameKind.HELLO, {"x": cyclic})
    with pytest.raises(LocalProtocolError, match="exceeds max_header_bytes 64"):
        encode_control(FrameKind.ERROR, {"reason": "x" * 100},
                       limits=WireLimits(max_header_bytes=64))


def test_wire_package_is_pure() -> None:
    import netdist.wire as wire

    for name in ("frame", "decoder", "handshake"):
        module = sys.modules[f"netdist.wire.{name}"]
        source = Path(module.__file__).read_text(encoding="utf-8")  # type: ignore[arg-type]
        for banned in ("import asyncio", "import socket", "from asyncio", "from socket",
                       "netdist.transport", "import pickle"):
            assert banned not in source, (name, banned)
    assert wire.encode_data is encode_data


def test_protocol_md_example_matches_encoder() -> None:
    """The hex dump in docs/PROTOCOL.md is the encoder's output, byte for byte."""
    text = (Path(__file__).parents[2] / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    block = text.split("Example (tag 7, float32 `[1.0, 2.0]`")[1].split("```")[1]
    dumped = bytes.fromhex("".join(re.split(r"\s{3,}", line)[0]  # drop the comment column
                                   for line in block.splitlines()))
    assert dumped == frame_bytes(encode_data(np.array([1.0, 2.0], np.float32), tag=7))
    heartbeat = text.split("A heartbeat is exactly `")[1].split("`")[0]
    assert bytes.fromhex(heartbeat) == encode_control(FrameKind.HEARTBEAT)
    assert "## Checkpoint layout" in text
