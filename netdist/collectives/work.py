"""``Work``: the handle an ``async_op=True`` collective returns.

The collective runs as a task owned by its group (the group's ``aclose`` cancels it);
the handle lets the caller overlap computation and collect the result later::

    work = await group.all_reduce(grads, async_op=True)
    loss = compute_something_else()
    await work            # -> grads, reduced; awaiting again returns the same result
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any

from netdist.errors import NetdistTimeoutError

__all__ = ["Work", "EagerStart"]


@dataclass(frozen=True)
class EagerStart:
    """A collective begun on the caller's thread without the event loop
    (``Group.all_reduce_eager``)."""

    result: Any
    """What the collective returns, once ``rest`` (if any) has run."""
    rest: Coroutine[Any, Any, None] | None
    """The part that has to wait, to run on the loop; ``None``: the call has finished."""


class Work:
    """A collective in flight. ``await work`` or ``await work.wait()`` returns its result.

    Awaiting never cancels the collective: if the awaiting task is cancelled, or
    ``wait(timeout=)`` expires, the collective keeps running (its own deadline still
    applies) and can be awaited again. An exception raised by the collective is raised
    by every await.
    """

    __slots__ = ("_task", "op", "_running")

    def __init__(self, task: asyncio.Future[Any], op: str,
                 running: asyncio.Event | None = None) -> None:
        self._task = task
        self.op = op
        """Name of the collective, e.g. ``"all_reduce"``."""
        self._running = running

    async def started(self) -> None:
        """Return once the collective has begun running (or has already finished).

        A collective handed out by ``async_op=True`` starts at the loop's next turn; this
        is the event to wait for before acting on a collective that is under way
        (closing its group, losing a peer) instead of guessing with ``sleep(0)``.
        """
        if self._running is None or self._running.is_set() or self._task.done():
            return
        waiter = asyncio.ensure_future(self._running.wait())
        try:
            await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def done(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._task.done()

    def result(self) -> Any:
        """The result of a finished collective (raises its exception, or
        ``asyncio.InvalidStateError`` while it is still running)."""
        return self._task.result()

    def exception(self) -> BaseException | None:
        """The exception of a finished collective, or None."""
        return self._task.exception()

    def cancel(self) -> bool:
        """Cancel the collective. Its peers then fail it too (by timeout or lost peer)."""
        return self._task.cancel()

    async def wait(self, timeout: float | None = None) -> Any:
        """Wait for the result; ``NetdistTimeoutError`` if ``timeout`` seconds pass first."""
        if self._task.done():
            return self._task.result()
        if timeout is None:
            return await asyncio.shield(self._task)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._task)
        except TimeoutError:
            if self._task.done():
                return self._task.result()
            raise NetdistTimeoutError(
                f"waiting for {self.op} timed out after {timeout:.2f}s "
                "(the collective is still running)") from None

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "pending"
        return f"<Work {self.op} {state}>"
