"""Shared-memory segments between ranks on one host (Linux ``memfd``).

A segment is an anonymous ``memfd`` file mapped into the creating rank. It has no name
in any shared namespace: nothing appears in ``/dev/shm``, so nothing is ever left there,
whichever rank is killed and when. The memory is freed by the kernel when the last rank
that mapped it unmaps it or dies.

Another rank of the same host attaches through ``/proc/<pid>/fd/<fd>`` of the creator,
which the kernel lets only processes of the same user (or root) open. The creator sends
that locator, with a 16-byte random cookie written at the head of the segment, over the
authenticated TCP transport, so a rank attaches only what a peer named after the
handshake; the attacher checks the cookie, the size and that the file is a netdist
memfd before using it.

Which ranks can share segments is what their host keys say
(``netdist.transport.host_identity.host_key``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import numpy as np

from netdist.errors import SharedMemoryError

__all__ = ["SegmentLocator", "SharedSegment", "HEADER_BYTES", "MEMFD_PREFIX"]

HEADER_BYTES = 64
"""The cookie sits at the head of a segment; data starts this far in (cache-line aligned)."""

MEMFD_PREFIX = "netdist-shm"
"""Name given to the memfd (shown as ``/memfd:netdist-shm`` in ``/proc/<pid>/fd``)."""

_COOKIE_BYTES = 16


@dataclass(frozen=True)
class SegmentLocator:
    """Where a peer on the same host finds a segment: the creator's pid and fd, the size
    in bytes and the cookie at its head. Sent over the authenticated transport."""

    pid: int
    fd: int
    size: int
    cookie: bytes

    def pack(self) -> list[object]:
        return [self.pid, self.fd, self.size, self.cookie]

    @classmethod
    def unpack(cls, fields: object) -> SegmentLocator:
        values = list(fields) if isinstance(fields, (list, tuple)) else []
        if not (len(values) == 4 and all(isinstance(v, int) for v in values[:3])
                and isinstance(values[3], bytes) and len(values[3]) == _COOKIE_BYTES
                and values[0] > 0 and values[1] >= 0 and values[2] > HEADER_BYTES):
            raise SharedMemoryError(f"malformed shared-memory locator {fields!r}")
        return cls(int(values[0]), int(values[1]), int(values[2]), bytes(values[3]))


class SharedSegment:
    """One mapped segment; ``array()`` gives NumPy views of its data area."""

    def __init__(self, fd: int | None, mapping: mmap.mmap, locator: SegmentLocator) -> None:
        self._fd = fd
        self._mapping = mapping
        self.locator = locator
        self._data: np.ndarray | None = np.frombuffer(mapping, np.uint8)[HEADER_BYTES:]

    @classmethod
    def create(cls, data_bytes: int) -> SharedSegment:
        """A new segment with ``data_bytes`` of data, readable and writable by this user only."""
        size = HEADER_BYTES + int(data_bytes)
        try:
            fd = os.memfd_create(MEMFD_PREFIX, os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise SharedMemoryError(f"cannot create a shared-memory segment: {exc}") from None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise SharedMemoryError(
                f"cannot size or map a {size}-byte shared-memory segment: {exc}") from None
        cookie = secrets.token_bytes(_COOKIE_BYTES)
        mapping[:_COOKIE_BYTES] = cookie
        return cls(fd, mapping, SegmentLocator(os.getpid(), fd, size, cookie))

    @classmethod
    def attach(cls, locator: SegmentLocator, *, peer: str) -> SharedSegment:
        """Map the segment ``locator`` names (sent by ``peer``), after checking it is one."""
        path = f"/proc/{locator.pid}/fd/{locator.fd}"
        try:
            target = os.readlink(path)
            if not target.startswith(f"/memfd:{MEMFD_PREFIX}"):
                raise SharedMemoryError(
                    f"{peer}'s shared-memory locator {path} names {target!r}, "
                    "not a netdist segment")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryError(f"cannot open {peer}'s shared-memory segment {path}: "
                                    f"{exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != locator.size:
                raise SharedMemoryError(
                    f"{peer}'s shared-memory segment {path} has {info.st_size} bytes, "
                    f"expected {locator.size}")
            if info.st_uid != os.getuid():
                raise SharedMemoryError(f"{peer}'s shared-memory segment {path} belongs to "
                                        f"uid {info.st_uid}, not to this user")
            mapping = mmap.mmap(fd, locator.size)
        except OSError as exc:
            raise SharedMemoryError(f"cannot map {peer}'s shared-memory segment {path}: "
                                    f"{exc}") from None
        finally:
            os.close(fd)
        if mapping[:_COOKIE_BYTES] != locator.cookie:
            mapping.close()
            raise SharedMemoryError(f"{peer}'s shared-memory segment {path} does not carry "
                                    "the cookie it announced")
        return cls(None, mapping, locator)

    @property
    def data_bytes(self) -> int:
        return self.locator.size - HEADER_BYTES

    def array(self, offset: int, nbytes: int) -> np.ndarray:
        """A ``uint8`` view of ``nbytes`` of the data area from ``offset``."""
        if self._data is None:
            raise SharedMemoryError("shared-memory segment is closed")
        if offset < 0 or offset + nbytes > self._data.size:
            raise SharedMemoryError(f"bytes {offset}..{offset + nbytes} are outside the "
                                    f"{self._data.size}-byte shared-memory segment")
        return self._data[offset:offset + nbytes]

    def release_fd(self) -> None:
        """Close the creator's descriptor once every peer has attached: from then on the
        mappings alone keep the memory, and no other process can attach."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Unmap (idempotent). Views still alive elsewhere keep the mapping until dropped."""
        self.release_fd()
        self._data = None
        with contextlib.suppress(BufferError):
            self._mapping.close()

    def __repr__(self) -> str:
        return (f"<SharedSegment pid={self.locator.pid} fd={self.locator.fd} "
                f"{self.data_bytes} bytes>")
