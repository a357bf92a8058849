"""Helpers for running every rank of a parameter-server job in one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


async def run_ranks(fns: Sequence[Callable[[], Awaitable[Any]]], *,
                    timeout: float = 30.0) -> list[Any]:
    """Run one coroutine per rank concurrently; results or exceptions, in rank order."""
    async with asyncio.timeout(timeout):
        return await asyncio.gather(*(fn() for fn in fns), return_exceptions=True)


def raise_any(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result
