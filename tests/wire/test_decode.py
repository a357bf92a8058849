"""Decoder: round trips, chunking, zero-copy receive, limits and remote errors."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netdist.config import WireLimits
from netdist.errors import LocalProtocolError, RemoteProtocolError
from netdist.types import WIRE_DTYPES
from netdist.wire import (
    NEED_DATA,
    ControlFrame,
    DataEnd,
    DataHeader,
    DataStart,
    FrameDecoder,
    FrameKind,
    encode_control,
    encode_data,
)

from netdist.wire.decoder import MAX_EXTENT_BYTES

from .helpers import decode_in_chunks, drain, frame_bytes, raw_frame, receive_via_buffers

SHAPES = [(), (0,), (0, 3), (1,), (5,), (2, 3), (2, 1, 4), (3, 0, 2)]


def _sample(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if raw.size else np.empty(shape, dtype)


def _decode_one(data: bytes, **kwargs: object) -> tuple[DataHeader, np.ndarray]:
    dec = FrameDecoder(**kwargs)  # type: ignore[arg-type]
    dec.feed(data)
    frame = dec.next_frame()
    assert isinstance(frame, tuple)
    assert dec.next_frame() is NEED_DATA
    return frame


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    dtype = WIRE_DTYPES[name]
    array = _sample(dtype, shape)
    header, payload = _decode_one(frame_bytes(encode_data(array, tag=11)))
    assert header == DataHeader(11, dtype, shape)
    assert header.nbytes == array.nbytes
    assert payload.dtype == dtype and payload.shape == shape
    assert payload.tobytes() == array.tobytes()
    assert payload.flags.c_contiguous and payload.flags.writeable


def test_round_trip_large_16mib_zero_copy() -> None:
    array = np.random.default_rng(1).standard_normal(4 * 1024 * 1024).astype(np.float32)
    data = frame_bytes(encode_data(array, tag=5))
    dest = np.empty(array.nbytes, dtype=np.uint8)
    dec = FrameDecoder()
    events = receive_via_buffers(dec, data, read_size=1 << 20, destinations={5: dest})
    assert [e[0] for e in events] == ["start", "end"]
    assert np.array_equal(dest.view(np.float32), array)
    header, payload = _decode_one(data)  # decoder-allocated, fed in one piece
    assert header.shape == (4 * 1024 * 1024,) and np.array_equal(payload, array)


def test_big_endian_and_strided_inputs_arrive_as_values() -> None:
    big = np.arange(6, dtype=">f8").reshape(2, 3)
    header, payload = _decode_one(frame_bytes(encode_data(big, tag=0)))
    assert header.dtype == np.dtype("<f8") and np.array_equal(payload, big)
    strided = np.arange(24, dtype=np.int16).reshape(4, 6)[::2, ::3]
    header, payload = _decode_one(frame_bytes(encode_data(strided, tag=0)))
    assert header.shape == (2, 2) and np.array_equal(payload, strided)


def test_control_frames_round_trip() -> None:
    fields = {"reason": "bye now", "n": [1, 2.5, None, True, b"\x00"], "m": {"k": "v"}}
    dec = FrameDecoder()
    dec.feed(encode_control(FrameKind.ERROR, fields) + encode_control(FrameKind.HEARTBEAT)
             + encode_control(FrameKind.BYE, {}))
    assert dec.next_event() == ControlFrame(FrameKind.ERROR, fields)
    assert dec.next_event() == ControlFrame(FrameKind.HEARTBEAT, {})
    assert dec.next_event() == ControlFrame(FrameKind.BYE, {})
    assert dec.next_event() is NEED_DATA
    assert not dec.in_frame


def test_empty_map_header_equals_h0() -> None:
    dec = FrameDecoder()
    dec.feed(raw_frame(FrameKind.OK, {}))  # H = 1 (0x80) instead of H = 0
    assert dec.next_event() == ControlFrame(FrameKind.OK, {})


# ---------------------------------------------------------------------------------------
# chunking: whole, byte by byte and random splits give identical events


def _stream() -> bytes:
    parts = [
        encode_control(FrameKind.HEARTBEAT),
        frame_bytes(encode_data(np.arange(7, dtype=np.int32), tag=1)),
        frame_bytes(encode_data(np.zeros((0, 3), np.float64), tag=2)),
        encode_control(FrameKind.ERROR, {"reason": "r", "x": [1, 2]}),
        frame_bytes(encode_data(np.float16(3.5), tag=2**63 - 1)),
        frame_bytes(encode_data(np.arange(300, dtype=np.uint8), tag=3)),
        frame_bytes(encode_data(np.array([True, False, True]), tag=4)),
        encode_control(FrameKind.BYE),
    ]
    return b"".join(parts)


STREAM = _stream()
WHOLE = decode_in_chunks(STREAM, [])


def test_whole_stream_events() -> None:
    kinds = [event[0] for event in WHOLE]
    assert kinds == ["control", "start", "end", "start", "end", "control",
                     "start", "end", "start", "end", "start", "end", "control"]
    assert WHOLE[2] == ("end", 1, "<i4", (7,), np.arange(7, dtype=np.int32).tobytes())
    assert WHOLE[7] == ("end", 2**63 - 1, "<f2", (), np.float16(3.5).tobytes())


def test_byte_by_byte_matches_whole() -> None:
    assert decode_in_chunks(STREAM, list(range(1, len(STREAM)))) == WHOLE


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=40))
def test_random_splits_match_whole(cuts: list[int]) -> None:
    assert decode_in_chunks(STREAM, sorted(cuts)) == WHOLE


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.sampled_from([16, 17, 40, 256, 4096]))
def test_buffered_protocol_reads_match_whole(read_size: int, scratch: int) -> None:
    dec = FrameDecoder(scratch_bytes=scratch)
    assert receive_via_buffers(dec, STREAM, read_size) == WHOLE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(WIRE_DTYPES)),
                          st.lists(st.integers(0, 4), max_size=3),
                          st.integers(0, 2**63 - 1)), min_size=1, max_size=6),
       st.data())
def test_multiple_frames_in_one_feed(specs: list[tuple[str, list[int], int]],
                                     data: st.DataObject) -> None:
    arrays = [(_sample(WIRE_DTYPES[name], tuple(shape), seed=i), tag)
              for i, (name, shape, tag) in enumerate(specs)]
    stream = b"".join(frame_bytes(encode_data(a, tag=t)) for a, t in arrays)
    dec = FrameDecoder(scratch_bytes=data.draw(st.sampled_from([16, 64, 1024])))
    dec.feed(stream)
    for array, tag in arrays:
        header, payload = dec.next_frame()  # type: ignore[misc]
        assert header.tag == tag and header.shape == array.shape
        assert payload.dtype == array.dtype and payload.tobytes() == array.tobytes()
    assert dec.next_frame() is NEED_DATA
    assert dec.buffered == 0 and not dec.in_frame


# ---------------------------------------------------------------------------------------
# zero-copy receive


def test_payload_lands_in_destination_via_get_buffer() -> None:
    array = np.arange(50_000, dtype=np.float32)  # 200 kB, far larger than scratch
    data = frame_bytes(encode_data(array, tag=9)) + encode_control(FrameKind.HEARTBEAT)
    dec = FrameDecoder(scratch_bytes=1024)
    dest = np.empty(array.nbytes, dtype=np.uint8)
    base = dest.ctypes.data
    pos = 0
    started = ended = False
    dest_views = 0
    outside_bytes = 0
    while pos < len(data):
        view = dec.get_buffer()
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        in_dest = base <= address < base + dest.nbytes
        if started and not ended:
            # after set_payload_destination every buffer is the rest of the destination
            assert in_dest and address + len(view) == base + dest.nbytes
            dest_views += 1
        n = min(len(view), 4000, len(data) - pos)
        view[:n] = data[pos:pos + n]
        dec.buffer_updated(n)
        if not in_dest:
            outside_bytes += n
        pos += n
        while (event := dec.next_event()) is not NEED_DATA:
            if isinstance(event, DataStart):
                assert event.header == DataHeader(9, np.dtype("<f4"), (50_000,))
                dec.set_payload_destination(dest)
                started = True
            elif isinstance(event, DataEnd):
                assert event.payload is dest
                ended = True
            else:
                assert event == ControlFrame(FrameKind.HEARTBEAT, {})
    assert ended and dest_views >= 40
    assert np.array_equal(dest.view(np.float32), array)
    # only the first read (prefix, header, start of payload) and the heartbeat hit scratch
    assert outside_bytes <= 1024 + 16


def test_destination_receives_bytes_already_in_scratch() -> None:
    array = np.arange(10, dtype=np.int64)
    dec = FrameDecoder()
    dec.feed(frame_bytes(encode_data(array, tag=1)))
    event = dec.next_event()
    assert isinstance(event, DataStart)
    dest = np.zeros(80, np.uint8)
    dec.set_payload_destination(dest)
    end = dec.next_event()
    assert isinstance(end, DataEnd) and end.payload is dest
    assert np.array_equal(dest.view(np.int64), array)


def test_destination_types() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = frame_bytes(encode_data(array, tag=1))
    for dest in (bytearray(24), memoryview(bytearray(24)), np.empty((2, 3), np.float32),
                 np.empty(6, np.int32)):
        dec = FrameDecoder()
        dec.feed(data)
        assert isinstance(dec.next_event(), DataStart)
        dec.set_payload_destination(dest)  # type: ignore[arg-type]
        end = dec.next_event()
        assert isinstance(end, DataEnd)
        assert isinstance(end.payload, np.ndarray) and end.payload.tobytes() == array.tobytes()
        assert bytes(memoryview(dest)) == array.tobytes()


@pytest.mark.parametrize("dest, message", [
    (np.empty(23, np.uint8), "holds 23 bytes but the frame carries 24"),
    (np.empty(48, np.uint8)[::2], "C-contiguous"),
    (np.frombuffer(bytes(24), np.uint8), "writable"),
    (bytes(24), "writable"),
    (bytearray(25), "holds 25 bytes"),
    (12, "must be a buffer"),
])
def test_bad_destinations_are_local_errors(dest: object, message: str) -> None:
    dec = FrameDecoder()
    dec.feed(frame_bytes(encode_data(np.zeros(6, np.float32), tag=1)))
    assert isinstance(dec.next_event(), DataStart)
    with pytest.raises(LocalProtocolError, match=message):
        dec.set_payload_destination(dest)  # type: ignore[arg-type]
    dec.set_payload_destination(None)  # the frame is still waiting; None still works
    assert isinstance(dec.next_event(), DataEnd)


def test_set_destination_without_data_start_is_a_local_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(LocalProtocolError, match="no data frame awaiting"):
        dec.set_payload_destination(None)


def test_get_buffer_after_data_start_allocates() -> None:
    array = np.arange(100, dtype=np.uint16)
    data = frame_bytes(encode_data(array, tag=1))
    dec = FrameDecoder(scratch_bytes=64)
    view = dec.get_buffer()
    view[:50] = data[:50]
    dec.buffer_updated(50)
    assert isinstance(dec.next_event(), DataStart)
    rest = dec.get_buffer()  # no destination set: the decoder allocates one
    assert len(rest) == len(data) - 50
    rest[:] = data[50:]
    dec.buffer_updated(len(rest))
    end = dec.next_event()
    assert isinstance(end, DataEnd) and np.array_equal(end.payload, array)


def test_buffer_updated_overrun_is_a_local_error() -> None:
    dec = FrameDecoder(scratch_bytes=64)
    view = dec.get_buffer()
    with pytest.raises(LocalProtocolError, match="overruns"):
        dec.buffer_updated(len(view) + 1)


def test_scratch_grows_for_large_headers_only_after_validation() -> None:
    array = np.zeros((1,) * 60, np.float32)
    data = frame_bytes(encode_data(array, tag=1, limits=WireLimits(max_ndim=64)))
    assert len(data) > 80
    dec = FrameDecoder(WireLimits(max_ndim=64), scratch_bytes=16)
    assert receive_via_buffers(dec, data, read_size=7)[1][0] == "end"
    dec = FrameDecoder(WireLimits(max_header_bytes=64), scratch_bytes=16)
    with pytest.raises(RemoteProtocolError, match="exceeds max_header_bytes 64"):
        receive_via_buffers(dec, data, read_size=7)


# ---------------------------------------------------------------------------------------
# limits at the edge (accepted) and one past (rejected)


def test_header_limit_edge() -> None:
    data = frame_bytes(encode_data(np.zeros((1,) * 30, np.float32), tag=2**63 - 1))
    hlen = int.from_bytes(data[4:8], "little")
    assert hlen >= 65
    _decode_one(data, limits=WireLimits(max_header_bytes=hlen))
    with pytest.raises(RemoteProtocolError,
                       match=f"^header length {hlen} exceeds max_header_bytes {hlen - 1}$"):
        _decode_one(data, limits=WireLimits(max_header_bytes=hlen - 1))


def test_payload_limit_edge() -> None:
    data = frame_bytes(encode_data(np.zeros(1000, np.uint8), tag=1))
    _decode_one(data, limits=WireLimits(max_payload_bytes=1000))
    with pytest.raises(RemoteProtocolError,
                       match="^payload length 1000 exceeds max_payload_bytes 999$"):
        _decode_one(data, limits=WireLimits(max_payload_bytes=999))


def test_ndim_limit_edge() -> None:
    data = frame_bytes(encode_data(np.zeros((1, 2, 1, 2)), tag=1))
    _decode_one(data, limits=WireLimits(max_ndim=4))
    with pytest.raises(RemoteProtocolError, match="^shape has 4 dims, more than max_ndim 3$"):
        _decode_one(data, limits=WireLimits(max_ndim=3))
    scalar = frame_bytes(encode_data(np.float32(1), tag=1))
    _decode_one(scalar, limits=WireLimits(max_ndim=0))


def test_dtype_allowed_edge() -> None:
    limits = WireLimits(allowed_dtypes=frozenset({"float32", "int8"}))
    _decode_one(frame_bytes(encode_data(np.zeros(3, np.float32), tag=1)), limits=limits)
    _decode_one(frame_bytes(encode_data(np.zeros(3, np.int8), tag=1)), limits=limits)
    with pytest.raises(RemoteProtocolError, match="^dtype 'float64' is not allowed"):
        _decode_one(frame_bytes(encode_data(np.zeros(3), tag=1)), limits=limits)


def test_limits_checked_before_allocation() -> None:
    # a prefix announcing an 8 GiB payload is refused from its 16 bytes alone
    dec = FrameDecoder(WireLimits(max_payload_bytes=2**20))
    dec.feed(raw_frame(0, hlen=30, plen=2**33)[:16])
    with pytest.raises(RemoteProtocolError, match="payload length 8589934592 exceeds"):
        dec.next_event()
    # a huge shape that does not match P is refused without allocating it
    dec = FrameDecoder()
    dec.feed(raw_frame(0, {"tag": 0, "dtype": "float64", "shape": [2**40, 2**40]}, b"\0" * 8))
    with pytest.raises(RemoteProtocolError, match="is 9671406556917033397649408 bytes but "
                                                  "the payload length is 8"):
        dec.next_event()


# ---------------------------------------------------------------------------------------
# malformed input: every violation is a RemoteProtocolError that names it

DATA_HDR = {"tag": 1, "dtype": "float32", "shape": [2]}
BAD_FRAMES = [
    (b"GET / HTTP/1.1\r\n\r\n", "bad magic b'GE' at frame start"),
    (b"G", "bad magic b'G' at frame start"),
    (raw_frame(0, DATA_HDR, bytes(8), version=2), "unsupported protocol version 2 "
                                                   "(this side speaks 1)"),
    (raw_frame(0, DATA_HDR, bytes(8), version=0)[:3], "unsupported protocol version 0"),
    (raw_frame(9), "unknown frame kind 9"),
    (raw_frame(200)[:4], "unknown frame kind 200"),
    (raw_frame(FrameKind.HEARTBEAT, None, b"abcd"), "HEARTBEAT frame carries a 4-byte payload"),
    (raw_frame(FrameKind.OK, [1, 2]), "OK header is a list, not a map"),
    (raw_frame(FrameKind.HELLO, b"\xc1"), "HELLO header is not valid msgpack"),
    (raw_frame(FrameKind.HELLO, msgpack.packb({b"k": 1})), "non-string map key b'k'"),
    (raw_frame(FrameKind.HELLO, msgpack.packb({"k": msgpack.Timestamp(1)})),
     "value of type Timestamp"),
    (raw_frame(FrameKind.HELLO, msgpack.packb({"k": msgpack.ExtType(3, b"x")})),
     "ext type 3 is not allowed"),
    (raw_frame(FrameKind.HELLO, msgpack.packb({1: 1})), "not valid msgpack"),
    (raw_frame(0, None, bytes(8)), "data frame has an empty header"),
    (raw_frame(0, b"\x80\x80", bytes(8)), "data frame header is not valid msgpack"),
    (raw_frame(0, [1, 2, 3], bytes(8)), "data frame header is a list, not a map"),
    (raw_frame(0, {"dtype": "float32", "shape": [2]}, bytes(8)), "lacks 'tag'"),
    (raw_frame(0, {**DATA_HDR, "x": 1}, bytes(8)), "unexpected keys 'x'"),
    (raw_frame(0, {**DATA_HDR, "tag": -1}, bytes(8)), "tag -1 is not an int in 0..2**63-1"),
    (raw_frame(0, {**DATA_HDR, "tag": 2**63}, bytes(8)), "tag 9223372036854775808 is not"),
    (raw_frame(0, {**DATA_HDR, "tag": True}, bytes(8)), "tag True is not"),
    (raw_frame(0, {**DATA_HDR, "tag": "1"}, bytes(8)), "tag '1' is not"),
    (raw_frame(0, {**DATA_HDR, "dtype": "complex64"}, bytes(8)),
     "dtype 'complex64' is not allowed"),
    (raw_frame(0, {**DATA_HDR, "dtype": ["f4"]}, bytes(8)), "dtype ['f4'] is not allowed"),
    (raw_frame(0, {**DATA_HDR, "shape": 2}, bytes(8)), "shape 2 is not a list"),
    (raw_frame(0, {**DATA_HDR, "shape": [-2]}, bytes(8)), "not a non-negative int"),
    (raw_frame(0, {**DATA_HDR, "shape": [2.0]}, bytes(8)), "not a non-negative int"),
    (raw_frame(0, {**DATA_HDR, "shape": [3]}, bytes(8)),
     "shape [3] of float32 is 12 bytes but the payload length is 8"),
    (raw_frame(0, DATA_HDR, bytes(8), plen=9), "is 8 bytes but the payload length is 9"),
]


@pytest.mark.parametrize("data, message", BAD_FRAMES)
def test_malformed_frames_raise_remote_protocol_error(data: bytes, message: str) -> None:
    dec = FrameDecoder()
    dec.feed(data)
    with pytest.raises(RemoteProtocolError) as info:
        drain(dec)
    assert message in str(info.value)
    # the decoder stays failed: the same error again, whatever comes next
    with pytest.raises(RemoteProtocolError) as again:
        dec.next_event()
    assert str(again.value) == str(info.value)
    assert dec.failed
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode_control(FrameKind.HEARTBEAT))
    with pytest.raises(RemoteProtocolError):
        dec.next_frame()
    view = dec.get_buffer()  # still usable by a protocol, data is discarded
    dec.buffer_updated(len(view))


def test_error_after_valid_frames_keeps_earlier_events() -> None:
    dec = FrameDecoder()
    dec.feed(encode_control(FrameKind.HEARTBEAT) + b"NX")
    assert dec.next_event() == ControlFrame(FrameKind.HEARTBEAT, {})
    with pytest.raises(RemoteProtocolError, match="bad magic b'NX'"):
        dec.next_event()


def test_truncated_stream_is_need_data_and_in_frame() -> None:
    data = frame_bytes(encode_data(np.arange(4, dtype=np.int32), tag=1))
    for cut in (1, 15, 16, 20, len(data) - 1):
        dec = FrameDecoder()
        dec.feed(data[:cut])
        events = drain(dec)
        assert all(event[0] == "start" for event in events)
        assert dec.in_frame  # an EOF here would be a truncated frame


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="scratch_bytes"):
        FrameDecoder(scratch_bytes=8)
    with pytest.raises(TypeError, match="WireLimits"):
        FrameDecoder(limits={})  # type: ignore[arg-type]
    assert repr(NEED_DATA) == "NEED_DATA" and str(NEED_DATA) == "NEED_DATA"


# ---------------------------------------------------------------------------------------
# shapes that multiply to zero (issue 12, item 11)
#
# The fuzz rule: any input either decodes or raises RemoteProtocolError, nothing else.
# A zero dimension makes prod(shape) * itemsize == P == 0 hold whatever the other
# dimensions are, so a huge one used to pass validation and make np.empty raise
# ValueError. The decoder now also bounds the non-zero dimensions times the itemsize by
# MAX_EXTENT_BYTES (what a NumPy array can address), with exact Python ints.


def _extent(shape: list[int], itemsize: int) -> int:
    extent = itemsize
    for dim in shape:
        extent *= dim or 1
    return extent


def _zero_frame(name: str, shape: list[int]) -> bytes:
    return raw_frame(0, {"tag": 3, "dtype": name, "shape": shape}, b"")


@pytest.mark.parametrize("name, shape", [
    ("uint8", [0, 2**63 - 1]),                # the largest empty array NumPy can describe
    ("float16", [2**62 - 1, 0]),
    ("float64", [0, 2**28, 2**32 - 1]),
    ("uint8", [0, 2**32, 2**31 - 1, 0]),
    ("bfloat16", [0, 4, 0, 2**40]),
])
def test_empty_arrays_with_large_dimensions_decode(name: str, shape: list[int]) -> None:
    header, payload = _decode_one(_zero_frame(name, shape))
    assert header == DataHeader(3, WIRE_DTYPES[name], tuple(shape)) and header.nbytes == 0
    assert payload.shape == tuple(shape) and payload.dtype == WIRE_DTYPES[name]
    assert payload.size == 0


@pytest.mark.parametrize("name, shape, extent", [
    ("float32", [0, 2**62], 2**64),           # the case: a 0 and a dimension 2**62
    ("uint8", [0, 2**63], 2**63),             # one past the limit
    ("float16", [2**62, 0], 2**63),
    ("uint8", [0, 2**32, 2**31], 2**63),
    ("int64", [3, 0, 2**64 - 1, 1], 24 * (2**64 - 1)),
])
def test_empty_arrays_beyond_numpy_are_remote_errors(name: str, shape: list[int],
                                                     extent: int) -> None:
    dec = FrameDecoder()
    dec.feed(_zero_frame(name, shape))
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert str(info.value) == (
        f"shape {shape!r} of {name} cannot be allocated: its non-zero dimensions span "
        f"{extent} bytes, more than the {MAX_EXTENT_BYTES} an array can address")
    assert dec.failed


def test_the_extent_limit_is_exact() -> None:
    """At the limit the frame decodes (NumPy agrees); one element past it is refused."""
    assert MAX_EXTENT_BYTES == np.iinfo(np.intp).max
    at_limit = [0, MAX_EXTENT_BYTES // 8]
    header, payload = _decode_one(_zero_frame("float64", at_limit))
    assert payload.shape == tuple(at_limit)
    with pytest.raises(ValueError):  # NumPy's own limit, one element further
        np.empty((0, MAX_EXTENT_BYTES // 8 + 1), np.float64)
    dec = FrameDecoder()
    dec.feed(_zero_frame("float64", [0, MAX_EXTENT_BYTES // 8 + 1]))
    with pytest.raises(RemoteProtocolError, match="cannot be allocated"):
        dec.next_frame()


_DIMS = st.one_of(
    st.just(0),
    st.integers(1, 4),
    st.sampled_from([2**k + d for k in (31, 32, 48, 61, 62, 63, 64) for d in (-1, 0, 1)
                     if 2**k + d < 2**64]),
    st.integers(0, 2**64 - 1),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(WIRE_DTYPES)),
       st.lists(_DIMS, min_size=1, max_size=6).filter(lambda dims: 0 in dims),
       st.booleans(), st.booleans())
def test_shapes_that_multiply_to_zero_decode_or_raise_remote_errors(
        name: str, shape: list[int], byte_by_byte: bool, with_destination: bool) -> None:
    dtype = WIRE_DTYPES[name]
    data = _zero_frame(name, shape)
    dec = FrameDecoder(scratch_bytes=64)
    events = []
    try:
        for i in range(len(data)) if byte_by_byte else [None]:
            dec.feed(data if i is None else data[i:i + 1])
            while (event := dec.next_event()) is not NEED_DATA:
                if isinstance(event, DataStart) and with_destination:
                    dec.set_payload_destination(bytearray(0))
                events.append(event)
    except RemoteProtocolError as exc:
        assert _extent(shape, dtype.itemsize) > MAX_EXTENT_BYTES
        assert "cannot be allocated" in str(exc) and dec.failed
        return
    assert _extent(shape, dtype.itemsize) <= MAX_EXTENT_BYTES
    assert [type(e) for e in events] == [DataStart, DataEnd]
    end = events[1]
    assert isinstance(end, DataEnd) and end.header.shape == tuple(shape)
    if not with_destination:
        assert end.payload.shape == tuple(shape) and end.payload.dtype == dtype


# ---------------------------------------------------------------------------------------
# switching limits between frames (a handshake under small limits, then the job's)


def test_set_limits_keeps_buffered_bytes_and_grows_scratch() -> None:
    small = WireLimits(max_header_bytes=64)
    hello = encode_control(FrameKind.HELLO, {"job": "j"})
    array = np.arange(40, dtype=np.int16).reshape(4, 10)
    data = hello + frame_bytes(encode_data(array, tag=5))
    dec = FrameDecoder(small, scratch_bytes=32)
    view = dec.get_buffer()
    view[:len(view)] = data[:len(view)]  # the HELLO and the start of the data frame
    dec.buffer_updated(len(view))
    assert dec.next_event() == ControlFrame(FrameKind.HELLO, {"job": "j"})
    dec.set_limits(WireLimits(), scratch_bytes=4096)
    assert len(dec.get_buffer()) == 4096 - (32 - len(hello))
    events = receive_via_buffers(dec, data[32:], read_size=1000)
    assert events[-1] == ("end", 5, "<i2", (4, 10), array.tobytes())


def test_set_limits_rechecks_a_prefix_already_read() -> None:
    wide = WireLimits(max_ndim=64)
    big_header = frame_bytes(encode_data(np.zeros((1,) * 60, np.uint8), tag=1, limits=wide))
    hlen = int.from_bytes(big_header[4:8], "little")
    assert hlen > 65
    dec = FrameDecoder(WireLimits(max_header_bytes=hlen, max_ndim=64))
    dec.feed(big_header[:20])  # prefix accepted under the old limit, header incomplete
    assert dec.next_event() is NEED_DATA
    dec.set_limits(WireLimits(max_header_bytes=hlen - 1, max_ndim=64))
    dec.feed(big_header[20:])
    with pytest.raises(RemoteProtocolError, match=f"header length {hlen} exceeds"):
        dec.next_event()


def test_set_limits_only_between_frames() -> None:
    dec = FrameDecoder()
    dec.feed(frame_bytes(encode_data(np.zeros(4, np.float32), tag=1))[:-1])
    assert isinstance(dec.next_event(), DataStart)
    with pytest.raises(LocalProtocolError, match="while a data frame is in progress"):
        dec.set_limits(WireLimits())
    with pytest.raises(TypeError, match="WireLimits"):
        FrameDecoder().set_limits({})  # type: ignore[arg-type]
    failed = FrameDecoder()
    failed.feed(b"XX")
    with pytest.raises(RemoteProtocolError):
        failed.next_event()
    failed.set_limits(WireLimits(max_header_bytes=64))  # a failed decoder stays failed
    assert failed.failed


def test_repeated_headers_are_still_checked_against_p() -> None:
    """Validated headers are cached by their bytes; a different P must still be refused."""
    good = frame_bytes(encode_data(np.zeros(2, np.float32), tag=1))
    dec = FrameDecoder()
    for _ in range(3):
        dec.feed(good)
        header, payload = dec.next_frame()  # type: ignore[misc]
        assert header == DataHeader(1, np.dtype("<f4"), (2,)) and payload.shape == (2,)
    hlen = int.from_bytes(good[4:8], "little")
    dec.feed(raw_frame(0, good[16:16 + hlen], bytes(12)))
    with pytest.raises(RemoteProtocolError, match="is 8 bytes but the payload length is 12"):
        dec.next_frame()


def test_many_distinct_headers() -> None:
    dec = FrameDecoder()
    for tag in range(200):
        dec.feed(frame_bytes(encode_data(np.full(tag % 5, tag, np.int32), tag=tag)))
    for tag in range(200):
        header, payload = dec.next_frame()  # type: ignore[misc]
        assert header.tag == tag and payload.tolist() == [tag] * (tag % 5)
