"""Bounded busy-polling while a small receive waits: the latency path of the transport.

An event loop with nothing ready blocks in ``epoll_wait``; when the reply arrives the
kernel has to wake the process, which on a virtual machine costs tens of microseconds
(a halted vCPU is woken by an interrupt): more than netdist's own work per message. MPI
libraries avoid this by polling for progress instead of sleeping. ``SpinPolicy`` does the
same within asyncio: while a receive of a small message is pending it keeps one callback
ready, so each loop iteration polls the sockets with a zero timeout instead of sleeping,
for at most ``seconds``; then the loop sleeps as usual. The spin ends as soon as the
message lands, so a reply that comes quickly costs no wake-up at all, and one that comes
late costs at most ``seconds`` of CPU.

Spinning steals CPU from other processes, which hurts when a host runs more ranks than
it has CPUs (they would spin while the rank they wait for cannot run), so the default
is to spin only when it does not (``default_spin_seconds``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["SpinPolicy", "default_spin_seconds", "ranks_sharing_host", "available_cpus",
           "DEFAULT_SPIN_US", "SPIN_MAX_BYTES"]

DEFAULT_SPIN_US = 100.0
"""Spin budget per small receive when the host is not oversubscribed, microseconds."""

SPIN_MAX_BYTES = 64 * 1024
"""Only receives whose ``out=`` holds at most this many bytes (or that have no ``out=``)
spin: large transfers are bandwidth-bound and their waits are long."""


def available_cpus() -> int:
    """CPUs this process may run on (affinity mask, so containers and taskset count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _host_key(host: str) -> str:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "loopback"
    except ValueError:
        pass
    return host.lower()


def ranks_sharing_host(hosts: Iterable[str], host: str) -> int:
    """How many of the advertised ``hosts`` are ``host`` (every loopback address counts
    as one host): the ranks competing for this machine's CPUs, as far as addresses tell."""
    key = _host_key(host)
    return sum(1 for other in hosts if _host_key(other) == key)


def default_spin_seconds(ranks_on_this_host: int, cpus: int | None = None) -> float:
    """The automatic spin budget: ``DEFAULT_SPIN_US`` unless ranks outnumber CPUs here."""
    cpus = available_cpus() if cpus is None else cpus
    return DEFAULT_SPIN_US * 1e-6 if ranks_on_this_host <= cpus else 0.0


class SpinPolicy:
    """How long a small receive keeps its event loop polling; shared by a transport's
    mailboxes so the budget can be set once the rendezvous table is known."""

    __slots__ = ("seconds", "polls")

    def __init__(self, seconds: float = 0.0) -> None:
        if not seconds >= 0:
            raise ValueError(f"spin budget must be >= 0 seconds, got {seconds}")
        self.seconds = seconds
        """Upper bound on polling per receive (0 disables spinning)."""
        self.polls = 0
        """Loop iterations spent polling so far (a cheap measure of CPU spent spinning)."""

    def applies_to(self, out: Any) -> bool:
        """True if a receive into ``out`` (``None``: a fresh array) should spin."""
        return self.seconds > 0 and (out is None or out.nbytes <= SPIN_MAX_BYTES)

    def watch(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        """Keep ``loop`` polling until ``future`` is done or the budget is spent."""
        end = time.perf_counter() + self.seconds
        call_soon = loop.call_soon
        clock = time.perf_counter

        def tick() -> None:
            if not future.done() and clock() < end:
                self.polls += 1
                call_soon(tick)

        call_soon(tick)
