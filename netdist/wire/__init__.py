"""Sans-I/O wire codec: frame encoder, incremental decoder and connection handshake.

Nothing here touches a socket or an event loop: bytes go in, events come out; arrays go
in, a list of buffers (the array's own memory among them) comes out. The transport layer
drives these objects. The frame format is specified in ``docs/PROTOCOL.md``.

This package is PURE: it imports neither asyncio nor socket.
"""

from netdist.wire.decoder import (
    NEED_DATA,
    ControlFrame,
    DataEnd,
    DataStart,
    Event,
    FrameDecoder,
    NeedData,
)
from netdist.wire.frame import (
    MAGIC,
    MAX_TAG,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    DataHeader,
    FrameKind,
    as_wire_array,
    encode_control,
    encode_data,
    encode_prefix,
    payload_view,
)
from netdist.wire.handshake import (
    ClientHandshake,
    HandshakeIdentity,
    HandshakeStep,
    ServerHandshake,
)

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
    "NEED_DATA",
    "NeedData",
    "ControlFrame",
    "DataStart",
    "DataEnd",
    "Event",
    "FrameDecoder",
    "HandshakeIdentity",
    "HandshakeStep",
    "ClientHandshake",
    "ServerHandshake",
]
