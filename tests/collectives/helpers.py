"""Helpers: run one coroutine per rank over in-process (or TCP) transports."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from netdist.collectives import Group
from netdist.transport import InProcessTransport, Transport

SMALL = 1 << 40
"""small_message_bytes forcing the latency-optimal algorithms."""
RING = 0
"""small_message_bytes forcing the ring / chain algorithms."""

GUARD = 60.0
"""Outer bound on any multi-rank test body; tests pass much smaller op timeouts."""


async def run_groups(transports: list[Transport], fn: Callable[[Group], Awaitable[Any]],
                     *, guard: float = GUARD, **group_kwargs: Any) -> list[Any]:
    """Make a world ``Group`` per transport and run ``fn(group)`` on all concurrently."""
    groups = [Group(t, **group_kwargs) for t in transports]
    try:
        async with asyncio.timeout(guard):
            return list(await asyncio.gather(*(fn(g) for g in groups)))
    finally:
        for g in groups:
            await g.aclose()


async def run_inprocess(n: int, fn: Callable[[Group], Awaitable[Any]], *,
                        timeout: float = 10.0, **group_kwargs: Any) -> list[Any]:
    transports = InProcessTransport.create_group(n, timeout=timeout)
    try:
        return await run_groups(transports, fn, **group_kwargs)
    finally:
        for t in transports:
            await t.aclose()


def assert_bitwise_equal(arrays: list[np.ndarray]) -> None:
    first = arrays[0]
    for index, other in enumerate(arrays[1:], 1):
        assert other.dtype == first.dtype and other.shape == first.shape
        assert other.tobytes() == first.tobytes(), f"rank {index} differs from rank 0"
