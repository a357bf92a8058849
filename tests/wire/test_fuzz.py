"""The fuzz rule: any input either decodes or raises RemoteProtocolError, nothing else."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netdist.config import WireLimits
from netdist.errors import RemoteProtocolError
from netdist.wire import NEED_DATA, DataStart, FrameDecoder, FrameKind, encode_control, encode_data

from .helpers import frame_bytes, raw_frame

SEEDS = [
    frame_bytes(encode_data(np.arange(3, dtype=np.float32), tag=7)),
    frame_bytes(encode_data(np.zeros((2, 0, 3), np.int64), tag=0)),
    frame_bytes(encode_data(np.uint16(9), tag=2**40)),
    encode_control(FrameKind.HEARTBEAT),
    encode_control(FrameKind.HELLO, {"version": 1, "job_id": "j", "rank": 1, "world_size": 2,
                                     "role": "rank", "nonce": bytes(32)}),
    encode_control(FrameKind.ERROR, {"reason": "no", "nested": {"a": [1, {"b": None}]}}),
    raw_frame(0, {"tag": 1, "dtype": "uint8", "shape": [2, 2]}, b"abcd"),
]

SMALL = WireLimits(max_header_bytes=256, max_payload_bytes=4096, max_ndim=4)


def _run(data: bytes, cuts: list[int], dest_choices: list[bool], limits: WireLimits) -> None:
    """Feed ``data`` in pieces; only events or RemoteProtocolError may come out."""
    dec = FrameDecoder(limits, scratch_bytes=64)
    choice = iter(dest_choices * 50)
    prev = 0
    try:
        for cut in [*sorted(cuts), len(data)]:
            dec.feed(data[prev:cut])
            prev = cut
            while (event := dec.next_event()) is not NEED_DATA:
                if isinstance(event, DataStart) and next(choice, False):
                    dec.set_payload_destination(np.empty(event.header.nbytes, np.uint8))
    except RemoteProtocolError:
        assert dec.failed
        try:
            dec.next_event()
        except RemoteProtocolError:
            return
        raise AssertionError("a failed decoder must keep failing")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=8),
       st.lists(st.booleans(), min_size=1, max_size=4))
def test_random_bytes(data: bytes, cuts: list[int], dests: list[bool]) -> None:
    _run(data, [c for c in cuts if c <= len(data)], dests, SMALL)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_after_a_valid_prefix(tail: bytes) -> None:
    # start with a plausible prefix so the header parser and validators get exercised
    _run(b"ND\x01" + tail, [], [True], WireLimits())
    _run(b"ND\x01\x00" + tail, [], [False], SMALL)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    frames = draw(st.lists(st.sampled_from(SEEDS), min_size=1, max_size=3))
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        else:
            del data[pos:]
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.lists(st.integers(0, 400), max_size=6),
       st.lists(st.booleans(), min_size=1, max_size=4))
def test_mutated_valid_frames(data: bytes, cuts: list[int], dests: list[bool]) -> None:
    _run(data, [c for c in cuts if c <= len(data)], dests, SMALL)
    _run(data, [], dests, WireLimits())


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4) | st.integers(-9, 9), children,
                      max_size=4),
    max_leaves=20))
def test_arbitrary_msgpack_headers(obj: object) -> None:
    header = msgpack.packb(obj, use_bin_type=True)
    for kind in (FrameKind.DATA, FrameKind.HELLO, FrameKind.BYE):
        _run(raw_frame(kind, header, b"" if kind else bytes(8)), [], [True], SMALL)
        if isinstance(obj, dict):
            _run(raw_frame(0, {**obj, "tag": 1, "dtype": "int8", "shape": [8]}
                           if all(isinstance(k, str) for k in obj) else header, bytes(8)),
                 [], [False], SMALL)
