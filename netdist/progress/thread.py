"""``ProgressThread``: an event loop that netdist owns, on a background thread.

With the asyncio API the transport's loop is the caller's own, so bytes move, heartbeats
go out and servers answer only while the caller awaits. A synchronous program (a torch
training loop, a script, a notebook) or one that computes for long stretches instead
runs the transport on a ``ProgressThread``: the thread's loop keeps every connection
moving while the caller computes (NumPy and torch release the GIL in large kernels, and
the interpreter switches threads every few milliseconds during pure-Python work), as
Gloo's and Horovod's background threads and MPI's progress engine do.

Who runs the loop. Handing each operation to another thread costs two thread wake-ups
(wake the loop, then wake the caller), which on a virtual machine is more than a small
collective itself. So, like an MPI progress engine whose caller drives progress while it
waits, the loop belongs to whichever thread holds its *baton*:

- while the caller waits in ``run()`` and the loop is free, the caller runs the loop
  itself (``run_until_complete``): no hand-off at all;
- when the caller returns, the progress thread leaves the loop to it for ``linger``
  seconds (a caller issuing operations back to back keeps driving), then takes the loop
  back and runs it until a caller wants it again;
- a caller that finds the loop taken hands its operation over (the hop) and the progress
  thread, having finished it, leaves the loop to the caller for the next one.

Either way only one thread runs the loop at a time, heartbeats and servers never stop
for longer than ``linger``, and the operations are the same coroutines.

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
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from netdist.errors import BlockingCallError, NetdistTimeoutError, TransportClosedError
from netdist.progress.loops import LoopFactory, progress_loop_factory

__all__ = ["ProgressThread", "wait_future", "DEFAULT_LINGER"]

T = TypeVar("T")

_CLOSE_SECONDS = 10.0
"""How long ``close()`` lets cancelled work on the loop wind down before giving up."""

DEFAULT_LINGER = 0.002
"""Seconds the progress thread leaves the loop to a caller that just used it."""


class ProgressThread:
    """An event loop on a dedicated thread that callers may also drive (module docstring).

    ::

        progress = ProgressThread().start()
        result = progress.run(transport_coroutine())       # blocks; may drive the loop
        future = progress.submit(other_coroutine())         # concurrent.futures.Future
        progress.close()
    """

    def __init__(self, *, name: str = "netdist-progress",
                 loop_factory: LoopFactory | None = None,
                 linger: float = DEFAULT_LINGER) -> None:
        if not linger >= 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger!r}")
        self.name = name
        self.linger = linger
        self._loop_factory = loop_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._baton = threading.Lock()
        """Held by the thread that runs the loop (the progress thread or a caller)."""
        self._turn = threading.Condition()
        """Guards ``_caller_active_at``, ``_callers_driving`` and ``_stopping``."""
        self._caller_active_at = float("-inf")
        self._callers_driving = 0
        self._stopping = False
        self._shutting_down = False
        self._stop_requested = False
        """Whether the progress thread's current ``run_forever`` was asked to stop."""

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
            factory = self._loop_factory or progress_loop_factory()
            loop = factory() if factory is not None else asyncio.new_event_loop()
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._startup_error = exc
            self._ready.set()
            return
        self._loop = loop
        loop.call_soon(self._ready.set)
        try:
            while self._wait_for_turn():
                if not self._baton.acquire(blocking=False):
                    continue  # a caller took it meanwhile
                try:
                    if not self._callers_idle():
                        continue  # a caller used it just now: leave it to them a bit longer
                    self._stop_requested = False
                    loop.run_forever()
                finally:
                    self._baton.release()
        finally:
            self._shutting_down = True  # from here on nothing may stop the loop
            with self._baton:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.run_until_complete(loop.shutdown_default_executor())
                finally:
                    loop.close()

    def _wait_for_turn(self) -> bool:
        """Sleep until no caller drives the loop or has for ``linger``; False to stop.

        Never blocks on the baton itself: a caller releasing it must not wake this thread.
        """
        with self._turn:
            while not self._stopping:
                if self._callers_driving:
                    self._turn.wait(max(self.linger, 0.001))  # re-checked, never notified
                    continue
                remaining = self._caller_active_at + self.linger - time.monotonic()
                if remaining <= 0:
                    return True
                self._turn.wait(remaining)
            return False

    def _callers_idle(self) -> bool:
        with self._turn:
            return self._stopping or (not self._callers_driving and time.monotonic()
                                      >= self._caller_active_at + self.linger)

    def _try_drive(self) -> bool:
        """Take the baton for the calling thread if the loop is free (announced first,
        so the progress thread never mistakes the gap for idleness)."""
        if asyncio._get_running_loop() is not None:
            return False
        with self._turn:
            self._callers_driving += 1
        if self._baton.acquire(blocking=False):
            return True
        with self._turn:
            self._callers_driving -= 1
        return False

    def _end_drive(self) -> None:
        with self._turn:
            self._callers_driving -= 1
            self._caller_active_at = time.monotonic()
        self._baton.release()

    def _caller_used_loop(self) -> None:
        with self._turn:
            self._caller_active_at = time.monotonic()

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
        """True when called from code the loop is running (on any thread)."""
        return (threading.current_thread() is self._thread
                or (self._loop is not None and asyncio._get_running_loop() is self._loop))

    def close(self, timeout: float = _CLOSE_SECONDS) -> None:
        """Cancel the work still on the loop, let it finish, stop the loop, join the thread.

        Idempotent and safe to call from any thread but the loop's own (there it raises
        ``BlockingCallError``: it would wait for itself).
        """
        with self._lock:
            if self._closed:
                return
            thread, loop = self._thread, self._loop
            if thread is not None and self.on_thread():
                raise BlockingCallError(f"{self.name}: close() called from the loop's own "
                                        "thread would wait for itself; call it from "
                                        "another thread")
            self._closed = True
        atexit.unregister(self.close)
        if thread is None or loop is None:
            return
        try:
            self._run(loop, _cancel_all(), timeout, "closing the progress thread")
        except (NetdistTimeoutError, RuntimeError):
            pass  # still stopped below; the thread is a daemon if a task refuses to die
        with self._turn:
            self._stopping = True
            self._turn.notify_all()
        loop.call_soon_threadsafe(self._stop_progress_run)
        thread.join(timeout)

    def __enter__(self) -> ProgressThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running work --------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future carries its result.

        Whoever runs the loop next runs it: the progress thread, or a caller in ``run()``
        or ``wait()``.
        """
        try:
            loop = self.loop
        except BaseException:
            coro.close()  # never awaited: close it quietly
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (or its exception).

        Drives the loop on the calling thread when it is free; otherwise hands ``coro``
        to the thread running it. ``timeout`` bounds the wait: on expiry the coroutine
        is cancelled and ``NetdistTimeoutError`` raised. An interrupt (Ctrl-C) also
        cancels it. Called from code the loop is running, it raises ``BlockingCallError``
        (``coro`` is closed unrun): waiting there would deadlock.
        """
        if self.on_thread():
            coro.close()
            raise BlockingCallError(f"{self.name}: run() would block the loop it runs on; "
                                    "await the coroutine there instead")
        try:
            loop = self.loop
        except BaseException:
            coro.close()
            raise
        return self._run(loop, coro, timeout, "the operation")

    def holding(self) -> LoopHold:
        """Hold the loop on this thread for a ``with`` block, if it is free: the block gets
        ``True`` while held; ``False`` when another thread runs the loop, or when entered
        from code the loop is running (then the block must not touch the loop's state).

        For operations that usually finish without waiting (a small all-reduce through
        shared memory, ``Group.all_reduce_eager``): holding the loop, the caller may use
        the state the loop's coroutines own, and skips the loop iterations a ``run()``
        costs. The block must not block: anything that has to wait is a coroutine for
        ``run()`` after the block.
        """
        return LoopHold(self)

    def try_call(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Call the synchronous ``fn`` while ``holding`` the loop: ``(True, fn())``, or
        ``(False, None)`` when the loop is not free (see ``holding``)."""
        with LoopHold(self) as held:
            return (True, fn()) if held else (False, None)

    def _run(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
             timeout: float | None, what: str) -> T:
        if self._try_drive():
            try:
                return self._drive(loop, coro, timeout, what)
            finally:
                self._end_drive()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        future.add_done_callback(self._leave_loop_to_caller)
        return wait_future(future, timeout, what)

    def _drive(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
               timeout: float | None, what: str) -> T:
        """Run the loop on this thread until ``coro`` is done (the baton is held)."""
        task = loop.create_task(coro)
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = None if timeout is None else loop.call_later(timeout, expire)
        try:
            return _run_until_complete(loop, task)
        except asyncio.CancelledError:
            if expired:
                raise NetdistTimeoutError(f"waiting for {what} timed out after "
                                          f"{timeout:.2f}s (it was cancelled)") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if not task.done():  # an interrupt: whoever drives next finishes the cancel
                task.cancel()

    def _leave_loop_to_caller(self, _: object) -> None:
        """A handed-over operation is done (its caller is being woken): the progress
        thread stops running the loop, so the caller's next operation drives it.

        Usually this runs on the progress thread, which completed the future. When the
        operation finished before the callback was attached, it runs at once on the
        caller's thread instead, where stopping the loop is not ours to do: the request
        is posted to the loop, whose thread honours it (``_stop_progress_run`` is a
        no-op on any other thread). Without that, the progress thread kept the loop and
        every later call handed its operation over.
        """
        self._caller_used_loop()
        if threading.current_thread() is self._thread:
            self._stop_progress_run()
            return
        loop = self._loop
        if loop is not None and not self._shutting_down:
            try:
                loop.call_soon_threadsafe(self._stop_progress_run)
            except RuntimeError:  # the loop closed meanwhile: nothing to stop
                pass

    def _stop_progress_run(self) -> None:
        """Make the progress thread's ``run_forever`` return (a no-op anywhere else:
        a caller driving the loop, or the final shutdown).

        At most once per run: uvloop's ``stop()`` queues a handle, and a second one
        queued after the first has run would stop the *next* run, whoever drives it.
        """
        if (threading.current_thread() is self._thread and not self._shutting_down
                and not self._stop_requested and self._loop is not None):
            self._stop_requested = True
            self._loop.stop()

    def wait(self, future: concurrent.futures.Future[T], timeout: float | None,
             what: str) -> T:
        """Wait for a submitted ``future``, driving the loop meanwhile when it is free.

        ``NetdistTimeoutError`` after ``timeout`` seconds; the work keeps running.
        """
        loop = self._loop
        budget = timeout
        if (not future.done() and loop is not None and not self._closed
                and not self.on_thread() and self._try_drive()):
            try:
                pending = asyncio.wrap_future(future, loop=loop)
                pending.add_done_callback(_retrieved)  # raised below, from ``future``
                _run_until_complete(loop, loop.create_task(asyncio.wait([pending],
                                                                        timeout=timeout)))
            finally:
                self._end_drive()
            budget = 0  # drove for the whole timeout already
        try:
            return future.result(budget)
        except concurrent.futures.TimeoutError:
            if future.done():  # the work's own TimeoutError (the same class since 3.11)
                raise
            raise NetdistTimeoutError(f"waiting for {what} timed out after {timeout:.2f}s "
                                      "(the operation is still running)") from None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Call the plain function ``fn(*args)`` where the loop's objects live (driving
        the loop, or on the progress thread) and return its result."""
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


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a finished mirror future's exception as retrieved: the caller raises it from
    the original future, so asyncio must not log it again as "never retrieved"."""
    if not future.cancelled():
        future.exception()


def _run_until_complete(loop: asyncio.AbstractEventLoop, task: asyncio.Future[T]) -> T:
    """``loop.run_until_complete(task)``, run again if a stray ``stop()`` (one queued by an
    earlier run that was interrupted, under uvloop) ends it before ``task`` is done."""
    for _ in range(3):
        try:
            return loop.run_until_complete(task)
        except RuntimeError:
            if task.done():
                raise
    return loop.run_until_complete(task)


async def _cancel_all() -> None:
    """Cancel every other task on the running loop and wait for them to finish."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class LoopHold:
    """``ProgressThread.holding()``: a plain context manager (no generator: it is on the
    per-call path of a small all-reduce, where a generator's frames cost microseconds)."""

    __slots__ = ("_progress", "_held")

    def __init__(self, progress: ProgressThread) -> None:
        self._progress = progress
        self._held = False

    def __enter__(self) -> bool:
        progress = self._progress
        if progress.on_thread() or not progress._try_drive():
            return False
        self._held = True
        try:
            progress.loop  # noqa: B018 - raises if the thread was closed
        except BaseException:
            self._held = False
            progress._end_drive()
            raise
        return True

    def __exit__(self, *exc_info: object) -> None:
        if self._held:
            self._held = False
            self._progress._end_drive()

