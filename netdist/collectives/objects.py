"""Encoding for the object collectives: msgpack only, never pickle.

Objects travel as msgpack (ints, floats, str, bytes, bool, None, lists, dicts; tuples
come back as lists). Each rank's blob starts with a status byte so a rank that cannot
encode its object still takes part in the exchange, and every other rank learns which
rank failed instead of waiting for a timeout.
"""

from __future__ import annotations

from typing import Any

import msgpack

from netdist.errors import CollectiveError, ObjectEncodeError

__all__ = ["pack_object_blob", "unpack_object_blob", "ObjectEncodeError"]

_OK = b"\x00"
_FAILED = b"\x01"


def pack_object_blob(obj: Any, op: str) -> tuple[bytes, ObjectEncodeError | None]:
    """Pack ``obj`` into the blob one rank sends in an object collective.

    Returns ``(blob, error)``: the status-prefixed msgpack of ``obj``, or a failure blob
    carrying the reason plus the ``TypeError`` to raise locally after the exchange.
    (The checkpoint's JSON codec for plain values is a different thing:
    ``netdist.checkpoint.metadata.encode_json_value``.)"""
    try:
        packed = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        reason = (f"{op}: object of type {type(obj).__name__} cannot be encoded with msgpack "
                  f"({exc}); only ints, floats, str, bytes, bool, None, lists and dicts can "
                  "be sent (netdist never pickles)")
        return _FAILED + reason.encode(), ObjectEncodeError(reason)
    return _OK + packed, None


def unpack_object_blob(blob: bytes, op: str, source: int) -> Any:
    """Unpack a :func:`pack_object_blob` blob from group rank ``source``;
    ``CollectiveError`` naming that rank if it could not pack its object."""
    if blob[:1] == _FAILED:
        raise CollectiveError(f"{op}: group rank {source} could not send its object: "
                              f"{blob[1:].decode(errors='replace')}")
    if blob[:1] != _OK:
        raise CollectiveError(f"{op}: malformed object blob from group rank {source}")
    return msgpack.unpackb(blob[1:], raw=False, strict_map_key=False)
