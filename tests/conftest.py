"""Shared test configuration: every async test runs on the standard loop and on uvloop."""

from __future__ import annotations

import asyncio

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
    uvloop = None


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item):
    """Parametrize async tests over the event loops netdist supports."""
    factories = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories
