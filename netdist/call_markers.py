"""PURE: marks on methods that the blocking API (``netdist.progress``) reads.

``thread_safe`` marks a plain method that may be called from any thread; ``eager_start``
marks a coroutine method whose blocking calls may begin on the caller's thread through a
named companion. The marks are attributes on the functions, so the layers that define
the methods (collectives, transport) need not import the progress layer that reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["EAGER_ATTRIBUTE", "THREAD_SAFE_ATTRIBUTE", "eager_start", "thread_safe"]


THREAD_SAFE_ATTRIBUTE = "__netdist_thread_safe__"
"""Set on methods that may be called from any thread (see ``thread_safe``)."""


EAGER_ATTRIBUTE = "__netdist_eager__"
"""Set on coroutine methods that have an eager companion (see ``eager_start``)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def thread_safe(fn: _F) -> _F:
    """Mark a plain method as safe to call from any thread.

    Such a method hands its work to the event loop itself (``call_soon_threadsafe``), so
    the blocking API's proxies (``netdist.progress``) call it directly from the caller's
    thread instead of making a round trip to the progress thread.
    """
    setattr(fn, THREAD_SAFE_ATTRIBUTE, True)
    return fn


def eager_start(companion: str) -> Callable[[_F], _F]:
    """Mark a coroutine method whose blocking calls may start on the caller's thread.

    ``companion`` names a plain method of the same object taking the same arguments,
    which the blocking API (``netdist.progress``) calls first, holding the event loop
    (``ProgressThread.try_call``): it returns ``None`` having done nothing (the coroutine
    then runs as usual) or an ``EagerStart`` (``netdist.collectives.work``), the call
    begun, and possibly finished, without an event-loop iteration.
    """
    def mark(fn: _F) -> _F:
        setattr(fn, EAGER_ATTRIBUTE, companion)
        return fn

    return mark
