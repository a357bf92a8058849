"""Single-copy transfers between processes on this host (Linux cross-memory attach).

``process_vm_readv(2)`` copies bytes from a peer process's address space straight into
this one's, and ``process_vm_writev(2)`` the other way, in one kernel copy and without a
shared staging area. The kernel allows them only where the caller may ptrace the peer:
the same user, and, under Yama's ``ptrace_scope`` 1 or more, not between sibling
processes at all (netdist never widens that itself). So every use is probed first
(``probe_peer`` reads a token back and writes it again), and a group whose ranks cannot
reach each other's memory keeps the staged shared-memory path.

``read_into`` and ``write_from`` are called without the GIL held (``ctypes`` releases
it), so a progress thread copying gigabytes does not stall the training thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
from dataclasses import dataclass

import numpy as np

__all__ = ["ProbeTarget", "ProbeToken", "RemoteReadError", "read_into", "write_from",
           "probe_peer", "available"]

_MAX_CALL_BYTES = 1 << 30
"""Largest single call: the kernel may return short for more; callers loop anyway."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _load(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load("process_vm_readv")
_WRITEV = _load("process_vm_writev")


def available() -> bool:
    """Whether this platform has cross-memory attach at all (a probe says if it works)."""
    return _READV is not None and _WRITEV is not None


class RemoteReadError(OSError):
    """A read or write of a peer's memory failed; ``errno`` says why (``ESRCH``: the peer
    is gone)."""


def read_into(pid: int, address: int, out: np.ndarray) -> None:
    """Copy ``out.nbytes`` bytes from ``address`` in process ``pid`` into ``out``
    (C-contiguous). Raises ``RemoteReadError`` if any byte cannot be read."""
    _transfer(_READV, "read", pid, address, out)


def write_from(pid: int, address: int, data: np.ndarray) -> None:
    """Copy ``data`` (C-contiguous) to ``address`` in process ``pid``. Raises
    ``RemoteReadError`` if any byte cannot be written."""
    _transfer(_WRITEV, "write", pid, address, data)


def _transfer(call: ctypes._CFuncPtr | None, verb: str,  # type: ignore[name-defined]
              pid: int, address: int, local_array: np.ndarray) -> None:
    """Move all of ``local_array``'s bytes to or from ``address`` in ``pid`` (the kernel
    may move fewer per call: loop until done)."""
    if call is None:
        raise RemoteReadError(errno.ENOSYS, "cross-memory attach is not available here")
    if not local_array.flags.c_contiguous:
        raise ValueError(f"a cross-memory {verb} needs a C-contiguous local array")
    base, total, done = local_array.ctypes.data, local_array.nbytes, 0
    local, remote = _IoVec(), _IoVec()
    while done < total:
        length = min(total - done, _MAX_CALL_BYTES)
        local.base, local.length = base + done, length
        remote.base, remote.length = address + done, length
        moved = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if moved <= 0:
            code = ctypes.get_errno() if moved < 0 else errno.EFAULT
            raise RemoteReadError(code, f"cannot {verb} {length} bytes at "
                                        f"{address + done:#x} of process {pid}: "
                                        f"{os.strerror(code)}")
        done += moved


@dataclass(frozen=True)
class ProbeTarget:
    """What a rank publishes so its peers can test reading its memory: its pid, and the
    address and value of a random token it keeps alive until every peer has probed."""

    pid: int
    address: int
    token: bytes

    def pack(self) -> list[object]:
        return [self.pid, self.address, self.token]

    @classmethod
    def unpack(cls, fields: object) -> ProbeTarget | None:
        """The target, or None for anything malformed (a probe of it then fails)."""
        values = list(fields) if isinstance(fields, (list, tuple)) else []
        if (len(values) == 3 and isinstance(values[0], int) and isinstance(values[1], int)
                and isinstance(values[2], bytes) and values[0] > 0 and values[1] > 0
                and 0 < len(values[2]) <= 64):
            return cls(values[0], values[1], values[2])
        return None


class ProbeToken:
    """A random token in this process's memory that peers read back to test access."""

    def __init__(self) -> None:
        self._buffer = np.frombuffer(bytearray(secrets.token_bytes(16)), np.uint8)

    @property
    def target(self) -> ProbeTarget:
        return ProbeTarget(os.getpid(), self._buffer.ctypes.data, self._buffer.tobytes())


def probe_peer(target: ProbeTarget | None, peer: str) -> str | None:
    """None if this process can read ``target``'s token back exactly and write it again
    (the same bytes: other ranks may be reading it meanwhile), else why not."""
    if target is None:
        return f"{peer} sent a malformed probe"
    got = np.empty(len(target.token), np.uint8)
    try:
        read_into(target.pid, target.address, got)
    except RemoteReadError as exc:
        return f"cannot read {peer}'s memory: {os.strerror(exc.errno or 0)}"
    if got.tobytes() != target.token:
        return f"{peer}'s memory does not hold the token it announced"
    try:
        write_from(target.pid, target.address, got)
    except RemoteReadError as exc:
        return f"cannot write {peer}'s memory: {os.strerror(exc.errno or 0)}"
    return None
