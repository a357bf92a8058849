"""Point-to-point messaging: the ``Transport`` contract and its implementations."""

from netdist.transport.base import MAX_TAG, Transport
from netdist.transport.inprocess import InProcessTransport

__all__ = ["Transport", "InProcessTransport", "MAX_TAG"]
