"""Helpers for running every rank of a parameter-server job in one event loop."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tests.ranks import gather_ranks

run_ranks = functools.partial(gather_ranks, guard=30.0, return_exceptions=True)
"""``await run_ranks([body, ...])``: one zero-argument coroutine function per rank (servers
and workers alike), run concurrently within 30 s; results or exceptions, in rank order."""


def raise_any(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result
