"""How the CLI's entry points run their coroutine: ``run()`` on a fresh loop.

The loop implementation is chosen in ``netdist.progress.loops`` (uvloop when installed;
``NETDIST_EVENT_LOOP=asyncio`` forces the standard loop, ``=uvloop`` requires uvloop),
the one place shared with the progress thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from netdist.progress.loops import default_loop_factory, event_loop_name

__all__ = ["run", "loop_factory", "event_loop_name"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The uvloop loop factory, or ``None`` for the standard loop (see module docstring)."""
    return default_loop_factory()


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
