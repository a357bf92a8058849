"""Sans-I/O wire codec: frame encoder, incremental decoder and connection handshake.

Nothing here touches a socket or an event loop: bytes go in, events come out; arrays go
in, a list of buffers (the array's own memory among them) comes out. The transport layer
drives these objects. The frame format is specified in ``docs/PROTOCOL.md``.

This package is PURE: it imports neither asyncio nor socket.

Names resolve lazily (``netdist._lazy``), like every netdist package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "MAGIC": "netdist.wire.frame",
    "PROTOCOL_VERSION": "netdist.wire.frame",
    "PREFIX_SIZE": "netdist.wire.frame",
    "MAX_TAG": "netdist.wire.frame",
    "FrameKind": "netdist.wire.frame",
    "DataHeader": "netdist.wire.frame",
    "as_wire_array": "netdist.wire.frame",
    "payload_view": "netdist.wire.frame",
    "encode_data": "netdist.wire.frame",
    "encode_control": "netdist.wire.frame",
    "encode_prefix": "netdist.wire.frame",
    "NEED_DATA": "netdist.wire.decoder",
    "NeedData": "netdist.wire.decoder",
    "ControlFrame": "netdist.wire.decoder",
    "DataStart": "netdist.wire.decoder",
    "DataEnd": "netdist.wire.decoder",
    "Event": "netdist.wire.decoder",
    "FrameDecoder": "netdist.wire.decoder",
    "HandshakeIdentity": "netdist.wire.handshake",
    "HandshakeStep": "netdist.wire.handshake",
    "ClientHandshake": "netdist.wire.handshake",
    "ServerHandshake": "netdist.wire.handshake",
}

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

if TYPE_CHECKING:
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
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
