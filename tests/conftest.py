"""Shared test configuration: every async test runs on the standard loop and on uvloop;
``require_in_ci`` for tests that need a program from the system."""

from __future__ import annotations

import asyncio
import os
from typing import NoReturn

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


def in_ci() -> bool:
    """``CI`` is set to a true value (``.ci/run`` exports ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_in_ci(missing: str) -> NoReturn:
    """A test cannot run because this machine lacks something from outside pip (``missing``
    says what and how to get it): a failure in CI, which installs every such requirement
    (``.ci/run``), so the test never passes there without running; a skip elsewhere,
    with that reason in pytest's summary (located at the caller's line)."""
    __tracebackhide__ = True
    if in_ci():
        pytest.fail(f"CI=true but {missing}", pytrace=False)
    pytest.skip(missing)
