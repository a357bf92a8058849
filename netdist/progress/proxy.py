"""The blocking API: any netdist object, driven from synchronous code.

``Blocking(obj, progress)`` stands for ``obj`` (a ``Group``, ``PSClient``, ``FSDP``,
aggregator, ``AsyncCheckpointer``, or a module such as ``netdist.checkpoint``) whose
coroutines run on the ``ProgressThread``'s loop (driven by the waiting caller when it is
free, else by the progress thread). There is one implementation of every operation, the
asyncio one; this proxy only decides where it runs and how the caller waits:

- an ``async def`` method becomes a blocking method with the same arguments that returns
  the coroutine's result; with ``async_op=True`` it returns a ``Handle`` at once
  (``wait()``, ``done()``, awaitable from any loop) whose result is the operation's;
- a plain method runs where the loop runs too (the object's asyncio state lives there)
  and its result is returned;
- results and attributes that are themselves netdist objects with coroutine methods
  (a subgroup from ``new_group``, a ``Work``) come back wrapped the same way;
- proxies passed as arguments are unwrapped, so ``save(state, path, group=job.group)``
  hands the real group to the real coroutine;
- ``with proxy:`` closes the object (``aclose()``) on exit;
- a method marked ``@thread_safe`` (it hands its work to the loop itself, like
  ``OverlapSession.ready``) is called directly from the caller's thread;
- a blocking call of a coroutine method marked ``@eager_start`` (``Group.all_reduce``)
  first tries its companion on the caller's thread while it holds the loop: a small
  all-reduce on one host usually finishes there, without an event-loop iteration.

``Awaiting(obj, progress)`` is the same for asyncio callers who want the progress thread:
every method returns an awaitable that runs the operation on the progress thread, so
the caller's own loop may block without stalling the transport.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from netdist.collectives.work import EagerStart, Work
from netdist.call_markers import EAGER_ATTRIBUTE, THREAD_SAFE_ATTRIBUTE
from netdist.progress.handle import Handle
from netdist.progress.thread import ProgressThread

__all__ = ["Blocking", "Awaiting", "run_eager", "unwrap", "unwrap_arguments"]


class _Flavor(enum.Enum):
    BLOCKING = "blocking"
    AWAITING = "awaiting"


class _Proxy:
    """Shared machinery of ``Blocking`` and ``Awaiting`` (see the module docstring)."""

    __slots__ = ("_target", "_progress")
    _FLAVOR = _Flavor.BLOCKING

    def __init__(self, target: Any, progress: ProgressThread) -> None:
        if isinstance(target, _Proxy):
            target = target._target
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_progress", progress)

    @property
    def target(self) -> Any:
        """The object this proxy stands for (use it only on the progress thread)."""
        return self._target

    @property
    def progress(self) -> ProgressThread:
        """The progress thread the object's coroutines run on."""
        return self._progress

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if getattr(value, THREAD_SAFE_ATTRIBUTE, False):
            return value  # safe from any thread: called directly, no round trip
        if _is_coroutine_function(value):
            return self._wrap_coroutine_function(value, name)
        if callable(value) and not isinstance(value, type):
            return self._wrap_function(value, name)
        return self._wrap_result(value)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, unwrap(value))

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._target)) | {"target", "progress"})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._target!r}>"

    # -- wrapping ------------------------------------------------------------------------

    def _wrap_result(self, value: Any) -> Any:
        if isinstance(value, Work):
            return Handle(self._progress.submit(_await_work(value)), value.op, self._progress)
        if _has_coroutine_methods(value):
            return type(self)(value, self._progress)
        return value

    def _wrap_function(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        progress = self._progress

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = unwrap_arguments(args, kwargs)
            return self._wrap_result(progress.call(functools.partial(fn, *args, **kwargs)))

        return call

    def _wrap_coroutine_function(self, fn: Callable[..., Coroutine[Any, Any, Any]],
                                 name: str) -> Callable[..., Any]:
        progress = self._progress
        flavor = self._FLAVOR

        companion = getattr(fn, EAGER_ATTRIBUTE, None)
        eager = (getattr(self._target, companion)
                 if companion is not None and flavor is _Flavor.BLOCKING else None)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = unwrap_arguments(args, kwargs)
            if eager is not None and not kwargs.get("async_op"):
                started = run_eager(progress, functools.partial(eager, *args, **kwargs))
                if started is not None:  # begun here, without a loop iteration
                    return self._wrap_result(started.result)
            coro = _resolved(fn(*args, **kwargs))
            if flavor is _Flavor.BLOCKING and not kwargs.get("async_op"):
                return self._wrap_result(progress.run(coro))
            handle = Handle(progress.submit(coro), name, progress)
            if flavor is _Flavor.AWAITING and kwargs.get("async_op"):
                return _ready(handle)
            return handle

        return call


class Blocking(_Proxy):
    """Synchronous stand-in for a netdist object (see the module docstring)."""

    __slots__ = ()
    _FLAVOR = _Flavor.BLOCKING

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.run(_close(self._target))


class Awaiting(_Proxy):
    """asyncio stand-in whose operations run on the progress thread."""

    __slots__ = ()
    _FLAVOR = _Flavor.AWAITING

    async def __aenter__(self) -> Awaiting:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await Handle(self._progress.submit(_close(self._target)), "close", self._progress)


async def _close(target: Any) -> None:
    """What leaving ``with`` / ``async with`` does: ``aclose()``, else ``close()``."""
    closer = getattr(target, "aclose", None) or getattr(target, "close", None)
    if closer is not None:
        result = closer()
        if inspect.isawaitable(result):
            await result


def run_eager(progress: ProgressThread,
              start: Callable[[], EagerStart | None]) -> EagerStart | None:
    """Call an eager companion (``start``, e.g. ``Group.all_reduce_eager``) on this thread
    while it holds the loop, and run whatever it left to finish on the loop. ``None``:
    the loop was not free or the companion declined; the caller runs the coroutine."""
    held, started = progress.try_call(start)
    if not held or started is None:
        return None
    if started.rest is not None:
        progress.run(started.rest)
    return started


def unwrap(value: Any) -> Any:
    """The real object behind a proxy (anything else is returned as it is)."""
    return value._target if isinstance(value, _Proxy) else value


def unwrap_arguments(args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every proxy replaced by the object it stands for."""
    return (tuple(unwrap(a) for a in args), {k: unwrap(v) for k, v in kwargs.items()})


async def _resolved(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await ``coro``; a ``Work`` it returns (``async_op=True``) is awaited too."""
    result = await coro
    if isinstance(result, Work):
        return await result
    return result


async def _await_work(work: Work) -> Any:
    return await work


async def _ready(value: Any) -> Any:
    return value


def _is_coroutine_function(value: Any) -> bool:
    return inspect.iscoroutinefunction(value) or (
        isinstance(value, functools.partial) and inspect.iscoroutinefunction(value.func))


def _has_coroutine_methods(value: Any) -> bool:
    """Whether ``value`` is a netdist object whose methods need the progress thread."""
    cls = type(value)
    if not cls.__module__.startswith("netdist.") or isinstance(value, (type, _Proxy)):
        return False
    return any(inspect.iscoroutinefunction(getattr(cls, name, None))
               for name in dir(cls) if not name.startswith("__"))
