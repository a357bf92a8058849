"""``NetdistWork``: torch's ``Work`` handle over an operation on netdist's progress thread.

Every call of the backend starts one coroutine on the job's ``ProgressThread`` and returns
at once with this handle, so ``async_op=True`` overlaps communication with the caller's
compute exactly as torch promises. ``wait()`` drives the event loop itself when the loop
is free (no thread hand-off on the synchronous path) and otherwise sleeps until the
progress thread has finished the operation. ``get_future()`` is the ``torch.futures.Future``
that DDP's reducer and communication hooks chain on; its value is the list of output
tensors, as with Gloo.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from netdist.errors import BlockingCallError
from netdist.progress.thread import ProgressThread
from netdist.torch.error_types import to_torch_error

__all__ = ["NetdistWork", "ENDED"]


def _ended() -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(None)
    return future


ENDED = _ended()
"""The future of every operation that ended before its ``NetdistWork`` was made (a
blocking call run in place): a completed future never changes, so they share one."""


class NetdistWork(dist.Work):
    """One backend operation in flight (see the module docstring)."""

    def __init__(self, future: concurrent.futures.Future[Any], progress: ProgressThread,
                 op: str, outputs: list[torch.Tensor],
                 source: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._future = future
        self._progress = progress
        self._op = op
        self._outputs = outputs
        self._source = source
        self._torch_future: torch.futures.Future[list[torch.Tensor]] | None = None
        # completed (with None) when the operation ends, however it ends: what wait()
        # waits on, so the progress thread never mirrors a failed future into asyncio;
        # not needed for an operation that already ended (a blocking call run in place)
        self._settled: concurrent.futures.Future[None] | None = None
        if not future.done():
            self._settled = concurrent.futures.Future()
            future.add_done_callback(self._settle)

    def _settle(self, _: concurrent.futures.Future[Any]) -> None:
        if self._settled is not None:
            self._settled.set_result(None)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the operation is done; raise its error as a torch error.

        ``timeout`` (torch's convention: zero means none) bounds this wait only; the
        operation's own deadline is the group's timeout. The wait is for completion
        (``_settled``, which never fails); the operation's error is then raised from its
        own future. Waiting on the failed future itself would leave asyncio's mirror of
        it (the progress thread wraps the future to drive the loop meanwhile) holding the
        error unread, logged at exit as "Future exception was never retrieved" beside the
        real error.
        """
        if not self._future.done() and self._progress.on_thread():
            raise BlockingCallError(f"{self._op}: wait() on netdist's progress thread would "
                                    "block the loop that completes it; chain on "
                                    "get_future() instead")
        try:
            if self._settled is not None:  # the operation had not ended at construction
                seconds = timeout.total_seconds() if timeout else 0.0
                self._progress.wait(self._settled, seconds or None, self._op)
            self._future.result()
        except BaseException as exc:  # noqa: BLE001 - translated for torch callers
            raise to_torch_error(exc) from exc.__cause__
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return (self._future.done() and not self._future.cancelled()
                and self._future.exception() is None)

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        if self._future.cancelled():
            return RuntimeError(f"{self._op} was cancelled")
        exc = self._future.exception()
        return None if exc is None else to_torch_error(exc)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """CPU work has nothing to synchronise with a stream."""

    def block_current_stream(self) -> None:
        """CPU work has no stream to block; waiting is ``wait()``."""

    def source_rank(self) -> int:
        """The rank a receive from any source got its message from."""
        self.wait()
        if self._source is None:
            raise ValueError(f"{self._op}: source_rank() is only defined for a receive "
                             "from any source")
        return self._source()

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A ``torch.futures.Future`` completed with the output tensors (or the error)."""
        if self._torch_future is None:
            fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            self._torch_future = fut

            def complete(done: concurrent.futures.Future[Any]) -> None:
                if done.cancelled():
                    fut.set_exception(RuntimeError(f"{self._op} was cancelled"))  # type: ignore[arg-type]
                elif done.exception() is not None:
                    fut.set_exception(to_torch_error(done.exception()))  # type: ignore[arg-type]
                else:
                    fut.set_result(self._outputs)

            self._future.add_done_callback(complete)
            # set_exception stores the error as the future's value, which only Python's
            # wait() turns back into an error; a then() callback that raises marks the
            # chained future failed in C++ too, so DDP's reducer raises netdist's message
            self._torch_future = fut.then(_value)
        return self._torch_future

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "running"
        return f"<NetdistWork {self._op} {state}>"


def _value(future: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
    return future.value()
