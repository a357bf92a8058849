"""``Handle``: an operation running on the progress thread, seen from any thread or loop.

The blocking API returns one for ``async_op=True``; ``ProgressThread``-backed jobs return
one from ``submit``. It is the thread-safe twin of ``netdist.collectives.Work``::

    handle = group.all_reduce(grads, async_op=True)   # returns at once
    loss = forward_next_batch()                        # overlaps with the all-reduce
    grads = handle.wait()                              # or: await handle (any loop)

Waiting never cancels the operation: ``wait(timeout=)`` expiring raises
``NetdistTimeoutError`` and leaves it running (its own deadline still applies), so it can
be waited for again. An exception raised by the operation is raised by every wait, as
the same ``netdist.errors`` exception the asyncio API raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from netdist.progress.thread import ProgressThread

__all__ = ["Handle"]

T = TypeVar("T")


class Handle(Generic[T]):
    """An operation in flight on the progress thread."""

    __slots__ = ("_future", "op", "_progress")

    def __init__(self, future: concurrent.futures.Future[T], op: str,
                 progress: ProgressThread) -> None:
        self._future = future
        self.op = op
        """What is running, e.g. ``"all_reduce"``."""
        self._progress = progress

    def done(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finishes and return its result (or raise its error).

        ``NetdistTimeoutError`` if ``timeout`` seconds pass first; the operation keeps
        running. An interrupt (Ctrl-C) in the waiting thread cancels the operation.
        """
        try:  # drives the loop while waiting, when it is free
            return self._progress.wait(self._future, timeout, self.op)
        except KeyboardInterrupt:
            self._future.cancel()
            raise

    def result(self) -> T:
        """The result of a finished operation (``InvalidStateError`` while it runs)."""
        if not self._future.done():
            raise asyncio.InvalidStateError(f"{self.op} is still running")
        return self._future.result()

    def exception(self) -> BaseException | None:
        """The exception of a finished operation, or None."""
        if not self._future.done():
            raise asyncio.InvalidStateError(f"{self.op} is still running")
        return self._future.exception()

    def cancel(self) -> bool:
        """Cancel the operation. Its peers then fail it too (by timeout or lost peer)."""
        return self._future.cancel()

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(handle)`` when the operation finishes (on the progress thread, or at
        once if it already has)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        """Await the result from any event loop (never cancels the operation)."""
        return asyncio.shield(asyncio.wrap_future(self._future)).__await__()

    def __repr__(self) -> str:
        return f"<Handle {self.op} {'done' if self._future.done() else 'pending'}>"
