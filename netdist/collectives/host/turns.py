"""``TurnQueue``: collectives that share one resource take it in issue order.

A group's shared-memory collectives reuse the same slots, so they must run one at a time,
and every rank must serve them in the same order: the order they were issued, which the
group's callers keep the same on every rank. Each collective takes a ticket when it is
issued and waits for its turn before touching the slots; a finished, failed or cancelled
collective hands the turn on. Once a queue is ``free`` (its resource turned out not to be
shared, say the group chose TCP), every ticket is served at once.
"""

from __future__ import annotations

import asyncio

__all__ = ["TurnQueue"]


class TurnQueue:
    """Tickets served one at a time, lowest first (module docstring)."""

    def __init__(self) -> None:
        self.free = False
        """Serve every ticket at once (nothing left to take turns on)."""
        self._issued = 0
        self._serving = 0
        self._abandoned: set[int] = set()
        self._changed: asyncio.Event | None = None

    def ticket(self) -> int:
        """The next turn (take it when the collective is issued, in issue order)."""
        ticket = self._issued
        self._issued += 1
        return ticket

    @property
    def idle(self) -> bool:
        """Every ticket taken so far is done: the next one would run at once."""
        return self._serving == self._issued

    def ready(self, ticket: int) -> bool:
        """True if ``ticket`` may run now."""
        return self.free or self._serving == ticket

    async def wait(self, ticket: int) -> None:
        """Return once ``ticket`` may run."""
        if self.ready(ticket):
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        while not self.ready(ticket):
            changed.clear()
            await changed.wait()

    def done(self, ticket: int) -> None:
        """``ticket`` no longer needs its turn (finished, failed or cancelled)."""
        self._abandoned.add(ticket)
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        if self._changed is not None:
            self._changed.set()
