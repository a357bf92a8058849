"""Frame layout (protocol version 1) and the encoder.

Every frame is a fixed 16-byte prefix, a msgpack header and a raw payload::

    offset  size  field
    0       2     magic b"ND"
    2       1     protocol version (1)
    3       1     frame kind (FrameKind)
    4       4     header length H (uint32, little-endian)
    8       8     payload length P (uint64, little-endian)
    16      H     header: a msgpack map with string keys; no ext types
    16+H    P     payload: raw little-endian C-order array bytes (data frames only)

The encoder never copies an array that is already little-endian and C-contiguous: the
payload buffer it returns is a ``uint8`` memoryview of the array's own memory, so a
transport can hand the header and the payload to ``writelines`` / ``sendmsg`` as they
are. ``docs/PROTOCOL.md`` specifies the format byte by byte.

This module is PURE: it imports neither asyncio nor socket.
"""

from __future__ import annotations

import enum
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from netdist.config import WireLimits
from netdist.errors import LocalProtocolError
from netdist.types import CARRIED_DTYPES, WIRE_DTYPES

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "PREFIX_SIZE",
    "MAX_TAG",
    "FrameKind",
    "DataHeader",
    "as_wire_array",
    "payload_view",
    "encode_data",
    "encode_control",
    "encode_prefix",
]

MAGIC = b"ND"
"""First two bytes of every frame."""

PROTOCOL_VERSION = 1
"""Version byte of every frame this implementation writes and the only one it reads."""

PREFIX_SIZE = 16
"""Size of the fixed frame prefix (magic, version, kind, H, P)."""

MAX_TAG = 2**63 - 1
"""Largest tag a data frame may carry (tags are non-negative and fit an int64)."""

PREFIX = struct.Struct("<2sBBIQ")
"""The 16-byte prefix: magic, version, kind, header length, payload length."""

_BIG_ENDIAN_HOST = sys.byteorder == "big"
_DEFAULT_LIMITS = WireLimits()


class FrameKind(enum.IntEnum):
    """The kind byte at offset 3. Only DATA frames carry a payload."""

    DATA = 0
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    OK = 4
    ERROR = 5
    HEARTBEAT = 6
    BYE = 7


@dataclass(frozen=True, slots=True)
class DataHeader:
    """The decoded header of a data frame: which tag, and the array's dtype and shape."""

    tag: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: ``prod(shape) * dtype.itemsize``."""
        return math.prod(self.shape) * self.dtype.itemsize


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# dtype -> (wire name, needs a byte swap); covers both byte orders of every wire dtype
_WIRE_NAME: dict[np.dtype[Any], tuple[str, bool]] = {}
for _name, _dt in CARRIED_DTYPES.items():  # bfloat16 too, with or without ml_dtypes
    _WIRE_NAME[_dt] = (_name, False)
    if _dt.itemsize > 1 and _dt.byteorder != "|":
        _swapped = _dt.newbyteorder(">" if not _BIG_ENDIAN_HOST else "<")
        _WIRE_NAME.setdefault(_swapped, (_name, True))
del _name, _dt


def _wire_name(dtype: np.dtype[Any]) -> tuple[str, bool]:
    """(wire name, needs byte swap) for ``dtype``; ``LocalProtocolError`` if unsupported."""
    found = _WIRE_NAME.get(dtype)
    if found is not None:
        return found
    name = dtype.name
    if name not in WIRE_DTYPES:
        raise LocalProtocolError(
            f"dtype {dtype} cannot be sent (supported: {', '.join(CARRIED_DTYPES)})")
    order = dtype.byteorder
    return name, order == ">" or (order == "=" and _BIG_ENDIAN_HOST)


def _normalise(data: Any) -> tuple[np.ndarray, str]:
    if type(data) is np.ndarray:
        array = data
    elif isinstance(data, np.ndarray):
        array = np.asarray(data)  # drop the subclass (matrix, masked array, ...)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        array = np.frombuffer(view, dtype=np.uint8)
    else:
        try:
            array = np.asarray(data)
        except Exception as exc:
            raise LocalProtocolError(
                f"cannot send an object of type {type(data).__name__}: {exc}") from None
    name, swap = _wire_name(array.dtype)
    if swap:
        array = array.astype(array.dtype.newbyteorder("<"), order="C")
    elif not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array, name


def as_wire_array(data: Any) -> np.ndarray:
    """View ``data`` as an array the wire can carry: little-endian, C-contiguous.

    ``bytes``, ``bytearray`` and ``memoryview`` become flat ``uint8`` arrays over the same
    memory; NumPy arrays that are already little-endian and C-contiguous are returned as
    they are (no copy). Big-endian or non-contiguous input is normalised with one explicit
    copy, because the payload is raw little-endian C-order bytes. Anything else goes
    through ``np.asarray``. Raises ``LocalProtocolError`` for a dtype the wire cannot
    carry (see ``netdist.types.CARRIED_DTYPES``).
    """
    return _normalise(data)[0]


def payload_view(array: np.ndarray) -> memoryview:
    """A flat ``uint8`` memoryview of a C-contiguous array's own memory (no copy)."""
    if not array.flags.c_contiguous:
        raise LocalProtocolError("payload_view needs a C-contiguous array")
    try:
        return array.data.cast("B")
    except (TypeError, ValueError, BufferError):  # no buffer format (bfloat16)
        return array.reshape(-1).view(np.uint8).data


def encode_prefix(kind: FrameKind | int, header_len: int, payload_len: int) -> bytes:
    """The 16-byte prefix of a frame (no validation beyond the field ranges)."""
    try:
        return PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind), header_len, payload_len)
    except struct.error as exc:
        raise LocalProtocolError(f"frame prefix field out of range: {exc}") from None


def _check_tag(tag: Any) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise LocalProtocolError(f"tag must be an int, got {type(tag).__name__}")
    tag = int(tag)
    if not 0 <= tag <= MAX_TAG:
        raise LocalProtocolError(f"tag {tag} is outside 0..2**63-1")
    return tag


def encode_data(data: Any, *, tag: int,
                limits: WireLimits | None = None) -> list[bytes | memoryview]:
    """Encode one data frame carrying ``data`` (an ndarray or bytes-like) on ``tag``.

    Returns ``[prefix + header]`` followed, when the payload is not empty, by a ``uint8``
    memoryview of the array's own memory: nothing is copied unless ``data`` had to be
    normalised (big-endian or non-contiguous; see ``as_wire_array``). The caller must not
    modify the array until the buffers have been written.

    Raises ``LocalProtocolError`` for an unsupported or disallowed dtype, more than
    ``limits.max_ndim`` dimensions, a header or payload over the limits, or a tag outside
    ``0..2**63-1``. ``limits`` defaults to ``WireLimits()``.
    """
    lim = _DEFAULT_LIMITS if limits is None else limits
    tag = _check_tag(tag)
    array, name = _normalise(data)
    if lim.allowed_dtypes is not None and name not in lim.allowed_dtypes:
        raise LocalProtocolError(
            f"dtype {name} is not allowed by the wire limits "
            f"(allowed: {', '.join(sorted(lim.allowed_dtypes))})")
    shape = array.shape
    if len(shape) > lim.max_ndim:
        raise LocalProtocolError(
            f"array has {len(shape)} dimensions, more than max_ndim {lim.max_ndim}")
    nbytes = array.nbytes
    if nbytes > lim.max_payload_bytes:
        raise LocalProtocolError(
            f"payload of {nbytes} bytes exceeds max_payload_bytes {lim.max_payload_bytes}")
    header = msgpack.packb({"tag": tag, "dtype": name, "shape": shape})
    if len(header) > lim.max_header_bytes:
        raise LocalProtocolError(
            f"header of {len(header)} bytes exceeds max_header_bytes {lim.max_header_bytes}")
    head = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header), nbytes) + header
    if nbytes == 0:
        return [head]
    return [head, payload_view(array)]


_SCALARS = (type(None), bool, int, float, str, bytes)


def check_fields(fields: Any, what: str = "fields") -> str | None:
    """Return why ``fields`` is not a valid control header value, or ``None`` if it is.

    Valid: nil, bool, int, float, str, bytes, lists/tuples of valid values, and maps
    whose keys are ``str`` at every level. No ext types (so no msgpack Timestamp).
    Iterative, so deeply nested input cannot exhaust the Python stack.
    """
    stack = [fields]
    budget = 1_000_000  # a cyclic structure must not loop forever
    while stack:
        budget -= 1
        if budget < 0:
            return f"{what} is too deeply nested or cyclic"
        value = stack.pop()
        kind = type(value)
        if kind in _SCALARS:
            continue
        if kind is dict:
            for key, item in value.items():
                if type(key) is not str:
                    return f"{what} has a non-string map key {_short(key)}"
                stack.append(item)
        elif kind is list or kind is tuple:
            stack.extend(value)
        else:
            return f"{what} contains a value of type {kind.__name__}"
    return None


def encode_control(kind: FrameKind | int, fields: dict[str, Any] | None = None, *,
                   limits: WireLimits | None = None) -> bytes:
    """Encode a control frame (HELLO..BYE): prefix plus msgpack header, no payload.

    ``fields`` is a map with ``str`` keys whose values are msgpack scalars, lists or
    maps (no ext types). An empty or missing map is encoded as ``H = 0`` (a bare
    16-byte frame, as heartbeats are sent). Raises ``LocalProtocolError`` for a DATA
    kind, unencodable fields or a header over ``limits.max_header_bytes``.
    """
    try:
        kind = FrameKind(kind)
    except ValueError:
        raise LocalProtocolError(f"unknown frame kind {kind!r}") from None
    if kind is FrameKind.DATA:
        raise LocalProtocolError("encode_control cannot encode DATA frames; use encode_data")
    if not fields:
        header = b""
    else:
        if type(fields) is not dict:
            raise LocalProtocolError(
                f"{kind.name} fields must be a dict, got {type(fields).__name__}")
        problem = check_fields(fields, f"{kind.name} fields")
        if problem is not None:
            raise LocalProtocolError(problem)
        try:
            header = msgpack.packb(fields, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise LocalProtocolError(f"cannot encode {kind.name} fields: {exc}") from None
    lim = _DEFAULT_LIMITS if limits is None else limits
    if len(header) > lim.max_header_bytes:
        raise LocalProtocolError(
            f"{kind.name} header of {len(header)} bytes exceeds max_header_bytes "
            f"{lim.max_header_bytes}")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(header), 0) + header
