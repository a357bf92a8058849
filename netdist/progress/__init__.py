"""The progress thread and the blocking API on top of it.

- ``ProgressThread``: an event loop netdist owns on a background thread, so bytes move,
  heartbeats go out and servers answer while the caller computes;
- ``Job`` / ``connect()``: a rank of a TCP job whose transport lives on that thread,
  driven from synchronous code;
- ``Blocking`` / ``Awaiting``: proxies that run any netdist object's coroutines on the
  thread, for synchronous callers and for asyncio callers respectively;
- ``Handle``: what ``async_op=True`` returns; ``wait()``, ``done()``, awaitable anywhere.

Names resolve lazily, so importing ``netdist.progress.loops`` (the loop choice the CLI
shares) does not pull in the transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "ProgressThread": "netdist.progress.thread",
    "Job": "netdist.progress.job",
    "connect": "netdist.progress.job",
    "Blocking": "netdist.progress.proxy",
    "Awaiting": "netdist.progress.proxy",
    "unwrap": "netdist.progress.proxy",
    "Handle": "netdist.progress.handle",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from netdist.progress.handle import Handle
    from netdist.progress.job import Job, connect
    from netdist.progress.proxy import Awaiting, Blocking, unwrap
    from netdist.progress.thread import ProgressThread
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
