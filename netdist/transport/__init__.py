"""Point-to-point messaging: the ``Transport`` contract and its implementations.

Names resolve lazily (``netdist._lazy``), so importing one module of this package does
not import the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "Transport": "netdist.transport.base",
    "MAX_TAG": "netdist.transport.base",
    "InProcessTransport": "netdist.transport.inprocess",
    "TcpTransport": "netdist.transport.tcp",
    "init": "netdist.transport.bootstrap",
    "create_local_tcp_group": "netdist.transport.local_tcp",
    "local_tcp_group": "netdist.transport.local_tcp",
    "p2p_benchmark": "netdist.transport.probe",
    "Traffic": "netdist.transport.traffic",
    "PeerTraffic": "netdist.transport.traffic",
}

__all__ = [
    "Transport",
    "InProcessTransport",
    "TcpTransport",
    "init",
    "create_local_tcp_group",
    "local_tcp_group",
    "p2p_benchmark",
    "MAX_TAG",
    "Traffic",
    "PeerTraffic",
]

if TYPE_CHECKING:
    from netdist.transport.base import MAX_TAG, Transport
    from netdist.transport.bootstrap import init
    from netdist.transport.inprocess import InProcessTransport
    from netdist.transport.local_tcp import create_local_tcp_group, local_tcp_group
    from netdist.transport.probe import p2p_benchmark
    from netdist.transport.tcp import TcpTransport
    from netdist.transport.traffic import PeerTraffic, Traffic
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
