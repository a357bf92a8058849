"""Shared helpers for the wire codec tests: frame building and event collection."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from netdist.wire import NEED_DATA, ControlFrame, DataEnd, DataStart, FrameDecoder


def frame_bytes(parts: list[bytes | memoryview]) -> bytes:
    """Concatenate the buffers ``encode_data`` returns into the bytes on the wire."""
    return b"".join(bytes(part) for part in parts)


def raw_frame(kind: int, header: bytes | dict[str, Any] | list[Any] | None = None,
              payload: bytes = b"", *, magic: bytes = b"ND", version: int = 1,
              hlen: int | None = None, plen: int | None = None) -> bytes:
    """Hand-build a frame, valid or not: every prefix field can be overridden."""
    if header is None:
        body = b""
    elif isinstance(header, bytes):
        body = header
    else:
        body = msgpack.packb(header, use_bin_type=True)
    prefix = struct.pack("<2sBBIQ", magic, version, kind,
                         len(body) if hlen is None else hlen,
                         len(payload) if plen is None else plen)
    return prefix + body + payload


def norm(event: object) -> tuple[Any, ...]:
    """A comparable summary of one decoder event (arrays compared by dtype/shape/bytes)."""
    if isinstance(event, ControlFrame):
        return ("control", event.kind, event.fields)
    if isinstance(event, DataStart):
        h = event.header
        return ("start", h.tag, h.dtype.str, h.shape)
    if isinstance(event, DataEnd):
        h = event.header
        return ("end", h.tag, h.dtype.str, h.shape, np.ascontiguousarray(event.payload).tobytes())
    raise AssertionError(f"unexpected event {event!r}")


def drain(dec: FrameDecoder) -> list[tuple[Any, ...]]:
    """Pull events until NEED_DATA; decoder allocates every payload."""
    events = []
    while (event := dec.next_event()) is not NEED_DATA:
        events.append(norm(event))
    return events


def decode_in_chunks(data: bytes, cuts: list[int], **kwargs: Any) -> list[tuple[Any, ...]]:
    """Feed ``data`` split at ``cuts`` (sorted offsets) and collect every event."""
    dec = FrameDecoder(**kwargs)
    events: list[tuple[Any, ...]] = []
    prev = 0
    for cut in [*cuts, len(data)]:
        dec.feed(data[prev:cut])
        prev = cut
        events.extend(drain(dec))
    return events


def receive_via_buffers(dec: FrameDecoder, data: bytes, read_size: int,
                        destinations: dict[int, np.ndarray] | None = None
                        ) -> list[tuple[Any, ...]]:
    """Drive ``dec`` like asyncio's BufferedProtocol: reads of at most ``read_size`` bytes.

    ``destinations`` maps tag -> flat uint8 array used as the payload destination.
    """
    events: list[tuple[Any, ...]] = []
    pos = 0
    while pos < len(data):
        view = dec.get_buffer()
        assert len(view) > 0
        n = min(len(view), read_size, len(data) - pos)
        view[:n] = data[pos:pos + n]
        dec.buffer_updated(n)
        pos += n
        while (event := dec.next_event()) is not NEED_DATA:
            if isinstance(event, DataStart) and destinations is not None:
                dec.set_payload_destination(destinations.get(event.header.tag))
            events.append(norm(event))
    return events
