"""The package is mypy-clean: ``python -m mypy netdist`` with the repo's ``[tool.mypy]``.

STYLE.md promises "type hints on everything public; py.typed; mypy-clean". This test
keeps the promise checked: it runs mypy in a subprocess (bounded wait) on the whole
``netdist`` package, with the configuration in ``pyproject.toml``, and prints mypy's
report when it finds anything. mypy is part of the ``test`` extra; the test is skipped
only when it is not importable.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MYPY_TIMEOUT = 600.0


@pytest.mark.slow
@pytest.mark.timeout(MYPY_TIMEOUT + 60)
def test_mypy_reports_no_errors(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not importable (install the test extra: pip install -e .[test])")
    command = [
        sys.executable, "-m", "mypy",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(tmp_path / "mypy_cache"),  # hermetic: no cache left in the repo
        "netdist",
    ]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=MYPY_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mypy did not finish within {MYPY_TIMEOUT:.0f} s; partial output:\n"
                    f"{_text(exc.stdout)}{_text(exc.stderr)}")
    report = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"`{' '.join(command[1:])}` exited with {done.returncode}:\n{report}")
    assert "Success: no issues found" in done.stdout, report


def _text(output: str | bytes | None) -> str:
    """Partial output of a timed-out run (bytes even with ``text=True``)."""
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output
