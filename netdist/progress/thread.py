"""``ProgressThread``: an event loop that netdist owns, on a background thread.

With the asyncio API the transport's loop is the caller's own, so bytes move, heartbeats
go out and servers answer only while the caller awaits. A synchronous program (a torch
training loop, a script, a notebook) or one that computes for long stretches instead
runs the transport on a ``ProgressThread``: the thread's loop keeps every connection
moving while the caller computes (NumPy and torch release the GIL in large kernels, and
the interpreter switches threads every few milliseconds during pure-Python work), as
Gloo's and Horovod's background threads and MPI's progress engine do.

The thread is started by ``start()`` and stopped by ``close()``, which cancels whatever
is still running on it, lets the cancellations finish (so transports send their BYE),
closes the loop and joins the thread: nothing is left behind. A thread that the caller
forgets to close is closed at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from netdist.errors import NetdistTimeoutError, TransportClosedError
from netdist.progress.loops import LoopFactory, default_loop_factory

__all__ = ["ProgressThread"]

T = TypeVar("T")

_CLOSE_SECONDS = 10.0
"""How long ``close()`` lets cancelled work on the loop wind down before giving up."""


class ProgressThread:
    """A running event loop on a dedicated thread, for submitting coroutines to.

    ::

        progress = ProgressThread().start()
        future = progress.submit(transport_coroutine())   # concurrent.futures.Future
        progress.close()
    """

    def __init__(self, *, name: str = "netdist-progress",
                 loop_factory: LoopFactory | None = None) -> None:
        self.name = name
        self._loop_factory = loop_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> ProgressThread:
        """Start the thread and its loop; returns ``self`` once the loop is running."""
        with self._lock:
            if self._closed:
                raise TransportClosedError(f"{self.name}: the progress thread is closed")
            if self._thread is not None:
                return self
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error
        atexit.register(self.close)
        return self

    def _main(self) -> None:
        try:
            factory = self._loop_factory or default_loop_factory()
            loop = factory() if factory is not None else asyncio.new_event_loop()
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._startup_error = exc
            self._ready.set()
            return
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())  # to_thread workers
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The thread's event loop (raises if the thread is not running)."""
        if self._loop is None or self._closed:
            raise TransportClosedError(f"{self.name}: the progress thread is not running")
        return self._loop

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``close()``."""
        return self._loop is not None and not self._closed

    def on_thread(self) -> bool:
        """True when called from the progress thread itself."""
        return threading.current_thread() is self._thread

    def close(self, timeout: float = _CLOSE_SECONDS) -> None:
        """Cancel the work still on the loop, let it finish, stop the loop, join the thread.

        Idempotent and safe to call from any thread but the progress thread itself.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, loop = self._thread, self._loop
        atexit.unregister(self.close)
        if thread is None or loop is None:
            return
        if threading.current_thread() is thread:
            raise RuntimeError(f"{self.name}: close() called from the progress thread itself")
        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # still stopped below; the thread is a daemon if a task refuses to die
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def __enter__(self) -> ProgressThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running work --------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future carries its result."""
        try:
            loop = self.loop
        except BaseException:
            coro.close()  # never awaited: close it quietly
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (or its exception).

        ``timeout`` bounds the wait: on expiry the coroutine is cancelled and
        ``NetdistTimeoutError`` raised. An interrupt (Ctrl-C) also cancels it.
        """
        if self.on_thread():
            coro.close()
            raise RuntimeError(f"{self.name}: run() would block the progress thread's own "
                               "loop; await the coroutine there instead")
        future = self.submit(coro)
        return wait_future(future, timeout, "the operation")

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Call the plain function ``fn(*args)`` on the loop's thread and return its result
        (for code that must run where the loop's objects live, e.g. constructors)."""
        if self.on_thread():
            return fn(*args)

        async def invoke() -> T:
            return fn(*args)

        return self.run(invoke(), timeout)


def wait_future(future: concurrent.futures.Future[T], timeout: float | None,
                what: str) -> T:
    """Wait for ``future``; cancel it on timeout (``NetdistTimeoutError``) or interrupt."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():
            return future.result()
        future.cancel()
        raise NetdistTimeoutError(f"waiting for {what} timed out after {timeout:.2f}s "
                                  "(it was cancelled)") from None
    except concurrent.futures.CancelledError:
        raise
    except BaseException:
        if not future.done():  # an interrupt in this thread, not the work's own error
            future.cancel()
        raise


async def _cancel_all() -> None:
    """Cancel every other task on the running loop and wait for them to finish."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
