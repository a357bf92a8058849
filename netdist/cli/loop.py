"""The one place in netdist that chooses an event loop.

Library code only ever uses the running loop; entry points run their coroutine through
``run()``, which uses uvloop when it is installed (a faster loop for socket-heavy code)
and the standard loop otherwise.
``NETDIST_EVENT_LOOP=asyncio`` forces the standard loop (for debugging, or to compare);
``NETDIST_EVENT_LOOP=uvloop`` requires uvloop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from netdist.errors import ConfigError

__all__ = ["run", "loop_factory", "event_loop_name"]

T = TypeVar("T")

_CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The uvloop loop factory, or ``None`` for the standard loop (see module docstring)."""
    choice = os.environ.get("NETDIST_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ConfigError(
            f"NETDIST_EVENT_LOOP={choice!r} is not one of {', '.join(_CHOICES)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("NETDIST_EVENT_LOOP=uvloop but uvloop is not installed") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def event_loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop ``run()`` would use (for reports)."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh loop (uvloop when available) and return its result.

    Like ``asyncio.run``: the loop is closed afterwards, remaining tasks are cancelled,
    and a ``KeyboardInterrupt`` cancels the main task before propagating.
    """
    try:
        factory = loop_factory()
    except BaseException:
        coro.close()  # avoid "coroutine was never awaited"
        raise
    if factory is None:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
