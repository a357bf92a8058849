"""Incremental, sans-I/O frame decoder with a zero-copy receive path.

The decoder never reads a socket. A transport drives it like an
``asyncio.BufferedProtocol``::

    view = dec.get_buffer()           # where the next bytes should land
    n = sock.recv_into(view)          # (or the event loop does this)
    dec.buffer_updated(n)
    while (event := dec.next_event()) is not NEED_DATA:
        if isinstance(event, DataStart):
            dec.set_payload_destination(landing_buffer)   # or None: decoder allocates
        ...

Prefixes and headers land in a small scratch buffer. As soon as a data frame's header is
decoded, ``next_event`` returns ``DataStart``; the caller then names the payload's
destination, the bytes of that payload already sitting in scratch are copied into it once,
and ``get_buffer`` hands out the rest of the destination itself, so a large payload is
received straight into its final buffer. ``DataEnd`` follows when the last byte is in.

Every check runs before anything is allocated: magic, version, kind, header and payload
lengths against ``WireLimits``, the msgpack header (a map with the right keys and types,
allowed dtype, ``ndim``, non-negative dimensions, ``prod(shape) * itemsize == P``, the
non-zero dimensions times the item size within ``MAX_EXTENT_BYTES`` (so a zero cannot
smuggle in a dimension NumPy cannot describe), tag in ``0..2**63-1``). The fuzz rule:
any input either decodes or raises ``RemoteProtocolError`` -- nothing else. After an
error the decoder stays failed.

This module is PURE: it imports neither asyncio nor socket.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack
import numpy as np

from netdist.config import WireLimits
from netdist.errors import LocalProtocolError, RemoteProtocolError
from netdist.types import CARRIED_DTYPES
from netdist.wire.frame import (
    MAGIC,
    MAX_TAG,
    PREFIX,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    DataHeader,
    FrameKind,
    _short,
    check_fields,
    payload_view,
)

__all__ = [
    "NEED_DATA",
    "NeedData",
    "ControlFrame",
    "DataStart",
    "DataEnd",
    "Event",
    "FrameDecoder",
    "MAX_EXTENT_BYTES",
]


class NeedData(enum.Enum):
    """Type of the ``NEED_DATA`` sentinel."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"

    __str__ = __repr__


NEED_DATA: Final = NeedData.NEED_DATA
"""Returned by ``next_event`` / ``next_frame`` when more bytes are needed (not an error)."""


@dataclass(frozen=True, slots=True)
class ControlFrame:
    """A decoded control frame (HELLO..BYE) and its header fields (``{}`` when empty)."""

    kind: FrameKind
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class DataStart:
    """A data frame's header is decoded; its payload follows.

    Call ``FrameDecoder.set_payload_destination`` before the next ``next_event`` or
    ``get_buffer`` to choose where the payload lands.
    """

    header: DataHeader


@dataclass(frozen=True, slots=True, eq=False)
class DataEnd:
    """A data frame's payload is complete.

    ``payload`` is the destination given to ``set_payload_destination`` (an ndarray as
    given, other buffers as a flat ``uint8`` ndarray over them) or, when none was given,
    an array the decoder allocated with the header's dtype and shape.
    """

    header: DataHeader
    payload: np.ndarray


Event = ControlFrame | DataStart | DataEnd | Literal[NeedData.NEED_DATA]

_KINDS = tuple(FrameKind)
_MAGIC0, _MAGIC1 = MAGIC[0], MAGIC[1]
_DATA_KEYS = frozenset(("tag", "dtype", "shape"))
_CACHE_ENTRIES = 64
_CACHE_KEY_BYTES = 96

MAX_EXTENT_BYTES: Final = int(np.iinfo(np.intp).max)
"""Largest byte span a shape may describe, its zero dimensions ignored (2**63-1 on 64-bit
hosts): NumPy cannot create an array, even an empty one, whose non-zero dimensions times
the item size exceed its address range."""

# decoder states
_FRAME = 0          # reading a prefix / header into scratch
_AWAIT_DEST = 1     # DataStart returned, waiting for set_payload_destination
_PAYLOAD = 2        # payload landing in the destination
_PAYLOAD_DONE = 3   # payload complete, DataEnd not yet returned
_FAILED = 4


_unpackb = msgpack.unpackb


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not allowed")


class FrameDecoder:
    """Turns a byte stream into ``ControlFrame`` / ``DataStart`` / ``DataEnd`` events.

    ``limits`` bound what a peer may make us allocate; ``scratch_bytes`` is the size of
    the buffer prefixes and headers are read into (it grows, up to
    ``16 + limits.max_header_bytes``, only when a validated header needs more room).
    """

    __slots__ = (
        "limits", "_max_header", "_max_payload", "_max_ndim", "_dtypes",
        "_scratch", "_mv", "_start", "_end", "_min_tail",
        "_state", "_error", "_hlen", "_plen", "_kind",
        "_header", "_payload", "_dview", "_off", "_pending", "_cache",
    )

    def __init__(self, limits: WireLimits = WireLimits(), *,
                 scratch_bytes: int = 256 * 1024) -> None:
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        if scratch_bytes < PREFIX_SIZE:
            raise ValueError(f"scratch_bytes must be >= {PREFIX_SIZE}, got {scratch_bytes}")
        self.limits = limits
        self._max_header = self._max_payload = self._max_ndim = 0
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._apply_limits(limits)
        self._scratch = bytearray(scratch_bytes)
        self._mv = memoryview(self._scratch)
        self._start = 0          # first unconsumed byte in scratch
        self._end = 0            # one past the last received byte in scratch
        self._min_tail = max(PREFIX_SIZE, scratch_bytes // 4)
        self._state = _FRAME
        self._error: str | None = None
        self._hlen = -1          # header length of the frame at _start, once its prefix is valid
        self._plen = 0
        self._kind = 0
        self._header: DataHeader | None = None
        self._payload: np.ndarray | None = None
        self._dview: memoryview | None = None
        self._off = 0
        self._pending: deque[memoryview] = deque()
        # validated headers by their exact bytes: a repeated header (same tag, dtype and
        # shape, as in a training loop) skips msgpack and validation. Bounded in count and
        # key size, so a peer cannot grow it.
        self._cache: dict[bytes, tuple[DataHeader, int]] = {}

    def _apply_limits(self, limits: WireLimits) -> None:
        self.limits = limits
        self._max_header = limits.max_header_bytes
        self._max_payload = limits.max_payload_bytes
        self._max_ndim = limits.max_ndim
        # bfloat16 decodes with or without ml_dtypes (as netdist.types.BFLOAT16_RAW without)
        names = CARRIED_DTYPES if limits.allowed_dtypes is None else limits.allowed_dtypes
        self._dtypes = {name: CARRIED_DTYPES[name] for name in names if name in CARRIED_DTYPES}

    def set_limits(self, limits: WireLimits, *, scratch_bytes: int | None = None) -> None:
        """Decode from the next frame on under ``limits``; keep every byte buffered so far.

        Lets a connection read its handshake under small limits and a small scratch buffer
        (a stranger who never authenticates must not cost what a peer does) and switch to
        the job's limits once the peer has proven who it is. ``scratch_bytes`` grows the
        scratch buffer (it never shrinks). A frame whose prefix was already checked is
        checked again under the new limits. Only between frames: while a data frame's
        payload is pending this raises ``LocalProtocolError``; on a failed decoder it
        does nothing.
        """
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        if self._state == _FAILED:
            return
        if self._state != _FRAME:
            raise LocalProtocolError("set_limits() called while a data frame is in progress")
        self._apply_limits(limits)
        self._cache.clear()   # headers validated under the old limits
        self._hlen = -1       # re-read (and re-check) a prefix already parsed
        if scratch_bytes is not None and scratch_bytes > len(self._scratch):
            self._make_room(scratch_bytes)
            self._min_tail = max(PREFIX_SIZE, scratch_bytes // 4)

    # -- introspection -----------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once the decoder has raised ``RemoteProtocolError``."""
        return self._error is not None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by an event (scratch plus ``feed`` queue)."""
        count = self._end - self._start
        if self._pending:
            count += sum(len(chunk) for chunk in self._pending)
        return count

    @property
    def in_frame(self) -> bool:
        """True while a frame is partially received (a clean EOF happens only when False)."""
        return self._state != _FRAME or self._end > self._start or bool(self._pending)

    # -- errors ------------------------------------------------------------------------

    def _fail(self, message: str) -> RemoteProtocolError:
        self._error = message
        self._state = _FAILED
        self._pending.clear()
        self._dview = None
        self._payload = None
        return RemoteProtocolError(message)

    # -- BufferedProtocol-shaped input -------------------------------------------------

    def get_buffer(self) -> memoryview:
        """A writable, non-empty view the next received bytes should be written into.

        While a payload is landing this is the rest of the payload's destination
        (zero-copy receive); otherwise it is the free tail of the scratch buffer. After a
        failure it is a throwaway view: data written there is discarded.
        """
        state = self._state
        if state == _PAYLOAD:
            return self._landing_view()[self._off:]
        if state == _AWAIT_DEST:
            self._set_destination(None)
            if self._state == _PAYLOAD:
                return self._landing_view()[self._off:]
        elif state == _FAILED:
            self._start = self._end = 0
            return self._mv
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = start = end = 0
        size = len(self._scratch)
        need = PREFIX_SIZE if self._hlen < 0 else PREFIX_SIZE + self._hlen
        if size - end < self._min_tail or size - start < need:
            self._make_room(need)
            end = self._end
            if end == len(self._scratch):
                raise LocalProtocolError(
                    "decoder scratch buffer is full: call next_event() after buffer_updated()")
        return self._mv[end:]

    def _landing_view(self) -> memoryview:
        """The payload destination while in the payload state (set by ``_set_destination``)."""
        dview = self._dview
        if dview is None:
            raise LocalProtocolError("decoder is receiving a payload but has no destination "
                                     "view (internal state error)")
        return dview

    def _make_room(self, need: int) -> None:
        """Move the unconsumed bytes to the front; grow scratch to ``need`` if needed.

        ``need`` is at most ``16 + max_header_bytes`` (the header length was validated
        before it was stored), so a peer cannot make scratch grow beyond the limits.
        """
        start, end = self._start, self._end
        count = end - start
        if len(self._scratch) < need:
            grown = bytearray(need)
            grown[:count] = self._mv[start:end]
            self._scratch = grown
            self._mv = memoryview(grown)
        elif start:
            self._mv[:count] = bytes(self._mv[start:end])
        self._start, self._end = 0, count

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the view last returned by ``get_buffer``."""
        state = self._state
        if state == _PAYLOAD:
            off = self._off + nbytes
            total = len(self._landing_view())
            if nbytes < 0 or off > total:
                raise LocalProtocolError(
                    f"buffer_updated({nbytes}) overruns the payload destination "
                    f"({total - self._off} bytes left)")
            self._off = off
            if off == total:
                self._state = _PAYLOAD_DONE
                self._dview = None
            return
        if state == _FAILED:
            return
        end = self._end + nbytes
        if nbytes < 0 or end > len(self._scratch):
            raise LocalProtocolError(
                f"buffer_updated({nbytes}) overruns the scratch buffer "
                f"({len(self._scratch) - self._end} bytes left)")
        self._end = end

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` for decoding (a convenience for tests and simple drivers).

        The bytes are copied through ``get_buffer``/``buffer_updated`` lazily, as
        ``next_event`` needs them, so a payload still lands in its destination and scratch
        never holds more than a prefix and header. ``bytes`` are queued without a copy;
        mutable buffers are copied first. Do not mix ``feed`` with ``get_buffer``.
        """
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        if type(data) is not bytes:
            data = bytes(data)
        if data:
            self._pending.append(memoryview(data))

    def _pump(self) -> None:
        """Move the next queued ``feed`` chunk (or as much of it as fits) into place."""
        chunk = self._pending[0]
        target = self.get_buffer()
        n = min(len(target), len(chunk))
        target[:n] = chunk[:n]
        self.buffer_updated(n)
        if n == len(chunk):
            self._pending.popleft()
        else:
            self._pending[0] = chunk[n:]

    # -- events ------------------------------------------------------------------------

    def next_event(self) -> ControlFrame | DataStart | DataEnd | NeedData:
        """The next event, or ``NEED_DATA``; raises ``RemoteProtocolError`` on bad input.

        After ``DataStart`` call ``set_payload_destination``; if ``next_event`` is called
        instead, the decoder allocates the payload array itself.
        """
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        while True:
            event = self._step()
            if event is not NEED_DATA or not self._pending:
                return event
            self._pump()

    def next_frame(self) -> ControlFrame | tuple[DataHeader, np.ndarray] | NeedData:
        """Whole frames only: a ``ControlFrame``, ``(header, payload)`` or ``NEED_DATA``.

        Payloads are allocated by the decoder (no destination is ever set).
        """
        while True:
            event = self.next_event()
            if isinstance(event, DataStart):
                continue
            if isinstance(event, DataEnd):
                return event.header, event.payload
            return event

    def _step(self) -> ControlFrame | DataStart | DataEnd | NeedData:
        state = self._state
        if state == _FRAME:
            start = self._start
            avail = self._end - start
            hlen = self._hlen
            if hlen < 0:
                if avail < PREFIX_SIZE:
                    if avail:
                        self._check_partial_prefix(start, avail)
                    return NEED_DATA
                magic, version, kind, hlen, plen = PREFIX.unpack_from(self._scratch, start)
                self._check_prefix(magic, version, kind, hlen, plen)
                self._hlen, self._plen, self._kind = hlen, plen, kind
            if avail < PREFIX_SIZE + hlen:
                return NEED_DATA
            hstart = start + PREFIX_SIZE
            self._start = hstart + hlen
            self._hlen = -1
            if self._kind == 0:
                raw = self._mv[hstart:hstart + hlen]
                if hlen <= _CACHE_KEY_BYTES:
                    key = raw.tobytes()
                    cached = self._cache.get(key)
                    if cached is not None and cached[1] == self._plen:
                        header = cached[0]
                    else:
                        header = self._parse_data_header(raw)
                        cache = self._cache
                        if len(cache) >= _CACHE_ENTRIES:
                            cache.clear()
                        cache[key] = (header, self._plen)
                else:
                    header = self._parse_data_header(raw)
                self._header = header
                self._state = _AWAIT_DEST
                return DataStart(header)
            return self._parse_control(self._mv[hstart:hstart + hlen])
        if state == _PAYLOAD_DONE:
            landed_header, payload = self._header, self._payload
            if landed_header is None or payload is None:
                raise LocalProtocolError("decoder finished a payload without its header or "
                                         "destination (internal state error)")
            event = DataEnd(landed_header, payload)
            self._header = self._payload = None
            self._state = _FRAME
            return event
        if state == _AWAIT_DEST:
            self._set_destination(None)
            return self._step()
        return NEED_DATA  # _PAYLOAD: waiting for more payload bytes

    # -- validation --------------------------------------------------------------------

    def _check_partial_prefix(self, start: int, avail: int) -> None:
        """Reject garbage as soon as its first bytes arrive (magic, version, kind)."""
        scratch = self._scratch
        if scratch[start] != _MAGIC0 or (avail > 1 and scratch[start + 1] != _MAGIC1):
            raise self._fail(
                f"bad magic {bytes(scratch[start:start + min(avail, 2)])!r} at frame start")
        if avail > 2 and scratch[start + 2] != PROTOCOL_VERSION:
            raise self._fail(
                f"unsupported protocol version {scratch[start + 2]} "
                f"(this side speaks {PROTOCOL_VERSION})")
        if avail > 3 and scratch[start + 3] >= len(_KINDS):
            raise self._fail(f"unknown frame kind {scratch[start + 3]}")

    def _check_prefix(self, magic: bytes, version: int, kind: int, hlen: int,
                      plen: int) -> None:
        if magic != MAGIC:
            raise self._fail(f"bad magic {magic!r} at frame start")
        if version != PROTOCOL_VERSION:
            raise self._fail(f"unsupported protocol version {version} "
                             f"(this side speaks {PROTOCOL_VERSION})")
        if kind >= len(_KINDS):
            raise self._fail(f"unknown frame kind {kind}")
        if hlen > self._max_header:
            raise self._fail(
                f"header length {hlen} exceeds max_header_bytes {self._max_header}")
        if plen > self._max_payload:
            raise self._fail(
                f"payload length {plen} exceeds max_payload_bytes {self._max_payload}")
        if kind:
            if plen:
                raise self._fail(f"{_KINDS[kind].name} frame carries a {plen}-byte payload; "
                                 "control frames have none")
        elif not hlen:
            raise self._fail("data frame has an empty header")

    def _unpack(self, raw: memoryview, what: str) -> Any:
        try:
            return msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                   ext_hook=_reject_ext)
        except Exception as exc:  # msgpack raises several types; all mean "bad header"
            raise self._fail(f"{what} header is not valid msgpack: "
                             f"{type(exc).__name__}: {_short(str(exc))}") from None

    def _parse_data_header(self, raw: memoryview) -> DataHeader:
        try:
            obj = _unpackb(raw, raw=False, strict_map_key=True, ext_hook=_reject_ext)
        except Exception:
            obj = self._unpack(raw, "data frame")  # raises with the reason
        if type(obj) is not dict:
            raise self._fail(f"data frame header is a {type(obj).__name__}, not a map")
        if len(obj) != 3 or "tag" not in obj or "dtype" not in obj or "shape" not in obj:
            missing = [key for key in ("tag", "dtype", "shape") if key not in obj]
            if missing:
                raise self._fail(f"data frame header lacks {', '.join(map(repr, missing))}")
            extra = sorted(map(repr, set(obj).difference(_DATA_KEYS)))
            raise self._fail(f"data frame header has unexpected keys {', '.join(extra)}")
        tag = obj["tag"]
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            raise self._fail(f"data frame tag {_short(tag)} is not an int in 0..2**63-1")
        name = obj["dtype"]
        dtype = self._dtypes.get(name) if type(name) is str else None
        if dtype is None:
            raise self._fail(f"dtype {_short(name)} is not allowed "
                             f"(allowed: {', '.join(self._dtypes)})")
        shape = obj["shape"]
        if type(shape) is not list:
            raise self._fail(f"data frame shape {_short(shape)} is not a list")
        if len(shape) > self._max_ndim:
            raise self._fail(
                f"shape has {len(shape)} dims, more than max_ndim {self._max_ndim}")
        extent = dtype.itemsize  # exact Python ints: no overflow, whatever the peer sent
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise self._fail(
                    f"shape {_short(shape)} has a dimension that is not a non-negative int")
            if dim:
                extent *= dim
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != self._plen:
            raise self._fail(f"shape {_short(shape)} of {name} is {nbytes} bytes but the "
                             f"payload length is {self._plen}")
        if extent > MAX_EXTENT_BYTES:
            # A zero dimension makes P = 0 match, yet NumPy cannot even describe the
            # empty array when the other dimensions span more than its address range.
            raise self._fail(
                f"shape {_short(shape)} of {name} cannot be allocated: its non-zero "
                f"dimensions span {extent} bytes, more than the {MAX_EXTENT_BYTES} an "
                "array can address")
        return DataHeader(tag, dtype, tuple(shape))

    def _parse_control(self, raw: memoryview) -> ControlFrame:
        kind = _KINDS[self._kind]
        if not raw:
            return ControlFrame(kind, {})
        obj = self._unpack(raw, f"{kind.name}")
        if type(obj) is not dict:
            raise self._fail(f"{kind.name} header is a {type(obj).__name__}, not a map")
        problem = check_fields(obj, f"{kind.name} header")
        if problem is not None:
            raise self._fail(problem)
        return ControlFrame(kind, obj)

    # -- payload destination -----------------------------------------------------------

    def set_payload_destination(self, buffer: memoryview | np.ndarray | None) -> None:
        """Choose where the payload of the data frame just started lands.

        ``buffer`` must be writable, C-contiguous and exactly ``header.nbytes`` long
        (any element type; typically a flat ``uint8`` array), else
        ``LocalProtocolError``. ``None`` makes the decoder allocate
        ``np.empty(shape, dtype)``. Payload bytes already in scratch are copied into it
        once; the rest is received straight into it through ``get_buffer``.
        """
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        if self._state != _AWAIT_DEST:
            raise LocalProtocolError(
                "set_payload_destination() called with no data frame awaiting a destination")
        self._set_destination(buffer)

    def _set_destination(self, buffer: memoryview | np.ndarray | None) -> None:
        header = self._header
        if header is None:
            raise LocalProtocolError("decoder awaits a payload destination without a decoded "
                                     "data header (internal state error)")
        nbytes = self._plen
        if buffer is None:
            try:
                result = np.empty(header.shape, header.dtype)
            except MemoryError:
                raise self._fail(f"cannot allocate {nbytes} bytes for the payload of a "
                                 f"data frame (tag {header.tag})") from None
            view = payload_view(result)
        elif isinstance(buffer, np.ndarray):
            flags = buffer.flags
            if not flags.c_contiguous or not flags.writeable:
                raise LocalProtocolError(
                    "payload destination must be a writable C-contiguous array")
            if buffer.nbytes != nbytes:
                raise LocalProtocolError(f"payload destination holds {buffer.nbytes} bytes "
                                         f"but the frame carries {nbytes}")
            result = buffer
            try:
                view = buffer.data.cast("B")
            except (TypeError, ValueError, BufferError):  # no buffer format (bfloat16)
                view = payload_view(buffer)
        else:
            try:
                view = memoryview(buffer)
            except TypeError:
                raise LocalProtocolError(
                    f"payload destination must be a buffer, got {type(buffer).__name__}"
                ) from None
            if view.readonly or not view.c_contiguous:
                raise LocalProtocolError(
                    "payload destination must be writable and C-contiguous")
            if view.nbytes != nbytes:
                raise LocalProtocolError(f"payload destination holds {view.nbytes} bytes "
                                         f"but the frame carries {nbytes}")
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            result = np.frombuffer(view, dtype=np.uint8)
        self._payload = result
        start = self._start
        take = min(self._end - start, nbytes)
        if take:
            view[:take] = self._mv[start:start + take]
            self._start = start + take
        if take == nbytes:
            self._state = _PAYLOAD_DONE
        else:
            self._dview = view
            self._off = take
            self._state = _PAYLOAD
