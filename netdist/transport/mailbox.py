"""Per-peer receive queues: match incoming frames to posted receives, by tag, in order.

One ``PeerMailbox`` holds everything rank ``peer`` has sent us. A frame reader calls
``claim()`` when a frame's header has arrived and gets a ``Landing``: the buffer its
payload must be written into. If a ``recv`` is already posted for that tag with ``out=``,
the buffer *is* ``out`` (zero-copy receive); otherwise a fresh array is allocated and
the message waits as "unexpected" until a ``recv`` takes it (copied once if that recv
passes ``out=``, handed over as is if not).

Order per tag is the order frames were claimed, even when a receive is posted while an
earlier frame is still landing: unexpected messages are queued as futures at claim time.
A receive that gives up (timeout, cancellation) after its frame was matched loses
nothing: the message goes to the next receive on the tag (``Landing``), so polling with
short timeouts, as a receive from any source does, never drops a message.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import LocalProtocolError, NetdistTimeoutError, PeerLostError
from netdist.transport.spin import SpinPolicy

__all__ = ["PeerMailbox", "Landing", "check_out_buffer", "byte_view"]


def byte_view(array: np.ndarray) -> np.ndarray:
    """A flat ``uint8`` NumPy view of a C-contiguous array's memory (no copy), for
    copying payload bytes between arrays of any dtype. (The checkpoint's
    ``storage.byte_memoryview`` is a ``memoryview`` for file I/O instead.)"""
    return array.reshape(-1).view(np.uint8) if array.ndim else array.reshape(1).view(np.uint8)


def check_out_buffer(out: np.ndarray) -> None:
    """Raise ``ValueError`` unless ``out`` can receive raw bytes in place."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out= must be a numpy.ndarray, got {type(out).__name__}")
    if not out.flags.c_contiguous:
        raise ValueError("out= must be C-contiguous to receive in place")
    if not out.flags.writeable:
        raise ValueError("out= is read-only")


def _naming_tag(error: Exception, tag: int, waited: bool) -> Exception:
    """A peer loss with the receive it cut short: "... while this rank waited for tag 5".

    Other errors (the local transport closed) already say everything there is to say.
    """
    if not isinstance(error, PeerLostError):
        return error
    where = (f"while this rank waited for tag {tag}" if waited
             else f"before this rank's recv on tag {tag}")
    return error.with_message(f"{error} {where}")


_SETTLED = np.empty(0, np.uint8)
"""What a settled ``Landing`` points at instead of the payload it delivered."""


@dataclass(slots=True)
class _PostedRecv:
    future: asyncio.Future[np.ndarray]
    out: np.ndarray | None


class Landing:
    """Where one incoming frame's payload goes; the reader fills ``buffer`` then completes.

    A frame matched to a posted ``recv`` keeps its message if that receive gives up
    (timeout, cancellation) while the payload is still arriving: a ``recv`` posted on the
    same tag meanwhile adopts it (``redirect``), and otherwise ``complete()`` hands it to
    ``orphan``, which queues it for the next one. Nothing a peer sent is dropped.
    """

    __slots__ = ("buffer", "_result", "_future", "_error", "_orphan", "_owned", "_settled")

    def __init__(self, buffer: np.ndarray, result: np.ndarray,
                 future: asyncio.Future[np.ndarray], error: Exception | None = None, *,
                 orphan: Callable[[np.ndarray], None] | None = None,
                 owned: bool = True) -> None:
        self.buffer = buffer
        """Flat uint8 array of exactly the payload size."""
        self._result = result
        self._future = future
        self._error = error
        self._orphan = orphan
        self._owned = owned
        """The buffer is the landing's own (not a receiver's ``out=``)."""
        self._settled = False

    def complete(self) -> None:
        """The payload is fully written: hand the message to its receiver (or the queue)."""
        result = self._settle()
        if self._future.done():  # the receiver gave up meanwhile: keep the message
            if self._future.cancelled() and self._orphan is not None and self._error is None:
                self._orphan(result if self._owned else result.copy())
            return
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(result)

    def fail(self, error: Exception) -> None:
        """The payload will never be complete (the connection died): wake its receiver.

        ``PeerMailbox.fail`` cannot reach a frame that is already landing into a posted
        ``recv``, since claiming took it off the posted queue; the reader fails it here.
        """
        self._settle()
        if not self._future.done():
            self._future.set_exception(error)

    def _settle(self) -> np.ndarray:
        """Mark the landing over and let go of its memory (the mailbox may still hold
        this object as the last landing); the message, for delivery."""
        result = self._result
        self._settled = True
        self._result = self.buffer = _SETTLED
        return result

    @property
    def settled(self) -> bool:
        """The payload completed or failed."""
        return self._settled

    @property
    def adoptable(self) -> bool:
        """Still landing into its own buffer, and its receiver gave up: a new ``recv`` on
        the tag may take the message over."""
        return not self._settled and self._owned and self._future.cancelled()

    def redirect(self, future: asyncio.Future[np.ndarray]) -> None:
        """Deliver the message to ``future`` (a receive that adopted it) instead."""
        self._future = future

    @property
    def withdrawn(self) -> bool:
        """True if the receiver gave up (timeout, cancellation) before ``complete()``
        while the payload lands in that receiver's own ``out=`` (memory it got back)."""
        return not self._owned and self._future.cancelled()


class PeerMailbox:
    """Receive state for messages from one peer rank."""

    def __init__(self, peer: int, loop: asyncio.AbstractEventLoop | None = None,
                 spin: SpinPolicy | None = None) -> None:
        self.peer = peer
        self._loop = loop
        self._spin = spin
        self._posted: dict[int, deque[_PostedRecv]] = {}
        self._unexpected: dict[int, deque[asyncio.Future[np.ndarray]]] = {}
        self._failure: Callable[[], Exception] | None = None
        self._landing: tuple[int, Landing] | None = None
        """The frame last matched to a posted receive, by tag (frames from one peer land
        one at a time)."""
        self.claim_times: dict[int, int] | None = None
        """While traced: per tag, when the last frame's header arrived
        (``time.monotonic_ns``), so a receive can tell waiting from moving bytes."""
        self.interrupted = False
        """This rank was waiting on the peer when it was lost (a receive posted, or a
        frame landing into one), or asked for a message after: the loss cut this rank's
        work short, even if the peer left politely (BYE)."""

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def failure(self) -> Exception | None:
        """The error every receive now raises, or ``None`` while the peer is alive."""
        return None if self._failure is None else self._failure()

    def _new_future(self) -> asyncio.Future[np.ndarray]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.create_future()

    # -- reader side -------------------------------------------------------------------

    def has_posted(self, tag: int) -> bool:
        """True if a ``recv`` is waiting on ``tag`` (the next frame lands in place)."""
        queue = self._posted.get(tag)
        return queue is not None and any(not entry.future.done() for entry in queue)

    def ready(self, tag: int) -> bool:
        """True if the next message on ``tag`` has arrived whole: a ``recv`` returns it at
        once, without posting a receive (so without waiting on the peer)."""
        queue = self._unexpected.get(tag)
        if not queue:
            return False
        head = queue[0]
        return head.done() and not head.cancelled() and head.exception() is None

    def claim(self, tag: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Landing:
        """Reserve the destination for the next frame on ``tag`` (header already decoded)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.claim_times is not None:
            self.claim_times[tag] = time.monotonic_ns()
        posted = self._posted.get(tag)
        while posted:
            entry = posted.popleft()
            if entry.future.done():  # withdrawn by timeout or cancellation
                continue
            if not posted:
                del self._posted[tag]
            orphan = functools.partial(self._orphaned, tag)
            if entry.out is None:
                result = np.empty(shape, dtype)
                landing = Landing(byte_view(result), result, entry.future, orphan=orphan)
            elif entry.out.nbytes != nbytes:
                error = LocalProtocolError(
                    f"recv from rank {self.peer} (tag {tag}): out= holds {entry.out.nbytes} "
                    f"bytes but the message carries {nbytes} ({dtype.name}{list(shape)})")
                return Landing(np.empty(nbytes, np.uint8), entry.out, entry.future, error)
            else:
                landing = Landing(byte_view(entry.out), entry.out, entry.future,
                                  orphan=orphan, owned=False)
            self._landing = (tag, landing)
            return landing
        if posted is not None:
            del self._posted[tag]
        future = self._new_future()
        self._unexpected.setdefault(tag, deque()).append(future)
        result = np.empty(shape, dtype)
        return Landing(byte_view(result), result, future)

    def fail(self, failure: Callable[[], Exception]) -> None:
        """Fail every posted receive and every later one with ``failure()``.

        Messages that had fully arrived before the failure stay receivable. A
        ``PeerLostError`` is told with the tag it cut short ("... while this rank waited
        for tag 5").
        """
        if self._failure is None:
            self._failure = failure
        landing = self._landing
        if (landing is not None and not landing[1].settled) or any(
                not entry.future.done() for queue in self._posted.values() for entry in queue):
            self.interrupted = True
        for tag, queue in self._posted.items():
            for entry in queue:
                if not entry.future.done():
                    entry.future.set_exception(_naming_tag(failure(), tag, waited=True))
        self._posted.clear()
        for waiting in self._unexpected.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(failure())

    def _orphaned(self, tag: int, message: np.ndarray) -> None:
        """A message whose receive gave up while it landed: first in line on ``tag`` (it
        was matched before any frame queued there since)."""
        future = self._new_future()
        future.set_result(message)
        self._unexpected.setdefault(tag, deque()).appendleft(future)

    def _adopt(self, tag: int) -> None:
        """Queue a message still landing on ``tag`` whose receive gave up, for this one."""
        landing = self._landing
        if landing is not None and landing[0] == tag and landing[1].adoptable:
            future = self._new_future()
            landing[1].redirect(future)
            self._unexpected.setdefault(tag, deque()).appendleft(future)

    # -- receiver side -----------------------------------------------------------------

    async def recv(self, tag: int, out: np.ndarray | None, timeout: float) -> np.ndarray:
        """Wait for the next message on ``tag``; see ``Transport.recv``."""
        if out is not None:
            check_out_buffer(out)
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._adopt(tag)
        queue = self._unexpected.get(tag)
        if queue:
            future = queue.popleft()
            if not queue:
                del self._unexpected[tag]
            try:
                message = await self._wait(future, tag, timeout, started, withdraw=None)
            except BaseException:
                # not taken (still landing, or landed as this recv was cancelled): it keeps
                # its place for the next recv
                self._unexpected.setdefault(tag, deque()).appendleft(future)
                raise
            if out is None:
                return message
            if out.nbytes != message.nbytes:
                raise LocalProtocolError(
                    f"recv from rank {self.peer} (tag {tag}): out= holds {out.nbytes} bytes "
                    f"but the message carries {message.nbytes} "
                    f"({message.dtype.name}{list(message.shape)})")
            byte_view(out)[...] = byte_view(message)
            return out
        if self._failure is not None:
            self.interrupted = True
            raise _naming_tag(self._failure(), tag, waited=False)
        entry = _PostedRecv(self._new_future(), out)
        self._posted.setdefault(tag, deque()).append(entry)
        spin = self._spin
        if spin is not None and spin.applies_to(out):
            spin.watch(loop, entry.future)
        return await self._wait(entry.future, tag, timeout, started, withdraw=entry)

    async def _wait(self, future: asyncio.Future[np.ndarray], tag: int, timeout: float,
                    started: float, withdraw: _PostedRecv | None) -> np.ndarray:
        if withdraw is None:  # an unexpected message: already here, or still landing
            if future.done():
                return future.result()
            try:
                async with asyncio.timeout(timeout):
                    return await asyncio.shield(future)
            except TimeoutError:
                if future.done():  # it landed as the deadline passed: take it
                    return future.result()
                raise self._timeout_error(tag, started) from None
        # A posted receive owns its future, so a plain timer that cancels it is enough
        # (asyncio.timeout costs several microseconds per call on the latency path).
        loop = asyncio.get_running_loop()
        expired = False

        def expire() -> None:
            nonlocal expired
            if not future.done():
                expired = True
                future.cancel()

        handle = loop.call_later(timeout, expire)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # the message landed just as this recv was cancelled: the next one gets it
                self._unexpected.setdefault(tag, deque()).appendleft(future)
                raise
            task = asyncio.current_task()
            if expired and (task is None or task.cancelling() == 0):
                raise self._timeout_error(tag, started) from None
            raise
        finally:
            handle.cancel()
            if not future.done():
                future.cancel()
            if future.cancelled():
                self._discard(tag, withdraw)

    def _timeout_error(self, tag: int, started: float) -> NetdistTimeoutError:
        elapsed = asyncio.get_running_loop().time() - started
        return NetdistTimeoutError(
            f"recv from rank {self.peer} (tag {tag}) timed out after {elapsed:.2f}s")

    def _discard(self, tag: int, entry: _PostedRecv) -> None:
        queue = self._posted.get(tag)
        if queue is None:
            return
        try:
            queue.remove(entry)
        except ValueError:
            return
        if not queue:
            del self._posted[tag]
