"""``netdist.cli.loop``: the only place that picks the event loop."""

from __future__ import annotations

import asyncio

import pytest

from netdist.cli import loop
from netdist.errors import ConfigError

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
    uvloop = None


async def _loop_module_and_value(value: int) -> tuple[str, int]:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__, value


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETDIST_EVENT_LOOP", raising=False)


def test_run_returns_the_result_on_uvloop_when_installed() -> None:
    module, value = loop.run(_loop_module_and_value(7))
    assert value == 7
    if uvloop is None:
        assert module.startswith("asyncio")
        assert loop.event_loop_name() == "asyncio"
    else:
        assert module.startswith("uvloop")
        assert loop.event_loop_name() == "uvloop"


def test_netdist_event_loop_asyncio_forces_the_standard_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_EVENT_LOOP", "asyncio")
    module, _ = loop.run(_loop_module_and_value(1))
    assert module.startswith("asyncio")
    assert loop.event_loop_name() == "asyncio"


def test_invalid_choice_is_a_config_error_and_the_coroutine_is_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_EVENT_LOOP", "trio")
    coro = _loop_module_and_value(1)
    with pytest.raises(ConfigError, match="NETDIST_EVENT_LOOP='trio'"):
        loop.run(coro)
    assert coro.cr_frame is None  # closed: no "never awaited" warning


def test_exceptions_propagate_and_no_loop_is_left_set() -> None:
    async def boom() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        loop.run(boom())
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()


def test_library_does_not_import_the_cli() -> None:
    import pathlib

    import netdist

    root = pathlib.Path(netdist.__file__).parent
    offenders = [str(path.relative_to(root)) for path in root.rglob("*.py")
                 if "cli" not in path.relative_to(root).parts
                 and path.name != "__main__.py"  # an entry point, like the CLI
                 and ("netdist.cli" in path.read_text() or "uvloop.install" in path.read_text()
                      or "set_event_loop_policy" in path.read_text())]
    assert offenders == []
