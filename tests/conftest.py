"""Shared test configuration: every async test runs on the standard loop and on uvloop;
``require_in_ci`` for tests that need a program from the system."""

from __future__ import annotations

import asyncio
import os
import signal
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


def pytest_configure(config: pytest.Config) -> None:
    """Give the processes the tests start a default SIGINT, even when the suite itself runs
    with SIGINT ignored (started with ``&`` from a non-interactive shell, as a CI runner's
    background step may be): children inherit an ignored signal, and the launcher keeps an
    ignored SIGINT ignored on purpose (``nohup``), so every test that presses Ctrl-C on a
    launcher, a rank or ``docker/up.sh`` would wait in vain. A Python-level handler is not
    inherited across ``exec``, so the children start with the default action."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

