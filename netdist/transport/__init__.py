"""Point-to-point messaging: the ``Transport`` contract and its implementations."""

from netdist.transport.base import MAX_TAG, Transport
from netdist.transport.inprocess import InProcessTransport
from netdist.transport.local import create_local_tcp_group, local_tcp_group
from netdist.transport.probe import p2p_benchmark
from netdist.transport.setup import init
from netdist.transport.tcp import TcpTransport

__all__ = [
    "Transport",
    "InProcessTransport",
    "TcpTransport",
    "init",
    "create_local_tcp_group",
    "local_tcp_group",
    "p2p_benchmark",
    "MAX_TAG",
]
