"""The one place in netdist that chooses an event loop implementation.

Library code only ever uses the running loop. The entry points that create a loop (the
CLI's ``run()`` and the ``ProgressThread``) ask ``default_loop_factory()``, which picks
uvloop when it is installed (a faster loop for socket-heavy code) and the standard loop
otherwise. ``NETDIST_EVENT_LOOP=asyncio`` forces the standard loop (for debugging, or to
compare); ``NETDIST_EVENT_LOOP=uvloop`` requires uvloop. Nothing here installs a policy:
the choice applies only to loops netdist creates itself.

The ``ProgressThread`` is the exception: by default it runs the standard loop
(``progress_loop_factory()``). Callers on the main thread drive that loop themselves
(``run_until_complete``) for every blocking operation, and uvloop sets up its signal
wake-up (a new socketpair and ``signal.set_wakeup_fd``) each time a run starts on the
main thread: 53 us per blocking call against 15 us for the standard loop, which made
netdist's 8-byte all-reduce through ``torch.distributed`` 3-5x slower than Gloo's instead
of 0.6x (``benchmarks/torch_ddp.py``); large transfers measured the same with both loops.
``NETDIST_EVENT_LOOP=uvloop`` still forces uvloop there.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from netdist.config import EVENT_LOOP_CHOICES, parse_choice
from netdist.errors import ConfigError

__all__ = ["LoopFactory", "default_loop_factory", "progress_loop_factory", "event_loop_name"]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]

def default_loop_factory() -> LoopFactory | None:
    """The uvloop loop factory, or ``None`` for the standard loop (see module docstring)."""
    choice = parse_choice(os.environ, "NETDIST_EVENT_LOOP", EVENT_LOOP_CHOICES, "auto")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("NETDIST_EVENT_LOOP=uvloop but uvloop is not installed") from None
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def progress_loop_factory() -> LoopFactory | None:
    """The progress thread's loop: the standard one unless ``NETDIST_EVENT_LOOP=uvloop``
    (see the module docstring for why)."""
    factory = default_loop_factory()  # validates NETDIST_EVENT_LOOP
    choice = parse_choice(os.environ, "NETDIST_EVENT_LOOP", EVENT_LOOP_CHOICES, "auto")
    return factory if choice == "uvloop" else None


def event_loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop netdist would create (for reports)."""
    return "asyncio" if default_loop_factory() is None else "uvloop"
