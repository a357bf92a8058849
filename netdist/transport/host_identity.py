"""The identity of a host, as the transport exchanges it at rendezvous (``host_key``).

``host_key()`` says which ranks can share memory segments: the same kernel boot, the same
PID and mount namespaces (``/proc`` must show the creator) and the same user.
``NETDIST_HOST_ID`` is appended when set, so tests and users can split the ranks of one
machine into pretend hosts (the hierarchical algorithms are then exercised on one box);
``DistributedConfig.host_id`` does the same for one rank, where several ranks share a
process (``local_tcp_group(n, host_ids=...)``).

Every transport publishes its rank's key (``Transport.host_keys``); the one-host path
above it (``netdist.collectives.host``) groups ranks by equal keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

__all__ = ["host_key"]


def host_key(host_id: str | None = None) -> bytes:
    """Bytes equal for exactly the processes that can attach each other's segments.

    ``host_id`` stands in for ``NETDIST_HOST_ID`` when given (``None``: the variable).
    """
    parts = [_read("/proc/sys/kernel/random/boot_id")]
    for ns in ("pid", "mnt", "ipc"):
        with contextlib.suppress(OSError):
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
    parts.append(f"uid:{os.getuid()}")
    if host_id is None:
        host_id = os.environ.get("NETDIST_HOST_ID", "")
    parts.append(f"host-id:{host_id}")
    return hashlib.sha256("\n".join(parts).encode()).digest()[:16]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
