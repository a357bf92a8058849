"""Small helpers for the transport tests."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for coordinators in tests)."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
