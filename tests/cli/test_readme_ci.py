"""The README's opening commands and ``.ci/run`` stay in step, and ``.ci/run`` fails right.

``.ci/run`` is exercised against stub ``python3`` / ``pip`` / ``python`` programs, so the
exit-status plumbing (a failing test, no tests collected, a failed install) is checked
without building a real virtualenv.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
CI_RUN = REPO_ROOT / ".ci" / "run"

TEST_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' "
                "&& python -m pytest")


def opening_commands() -> list[str]:
    """The fenced blocks between the title's pitch and the first section heading."""
    text = README.read_text()
    head = text.split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", head, flags=re.S)]


def test_readme_opens_with_exactly_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# netdist"
    assert lines[1] == "" and lines[2] and lines[3] == ""  # the one-sentence pitch
    assert lines[4] == "```sh"
    commands = opening_commands()
    assert len(commands) == 2
    for command in commands:
        assert "\n" not in command
    run_job, run_tests = commands
    assert run_job.startswith("python3 -m venv .venv && . .venv/bin/activate && "
                              "pip install -e '.[demo]' && netdist ")
    assert run_tests == TEST_COMMAND


def test_ci_runs_the_readme_test_command() -> None:
    text = CI_RUN.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert os.stat(CI_RUN).st_mode & stat.S_IXUSR
    assert opening_commands()[1] + ' "$@"' in text
    assert "Docker image build (issue 8)" in text


STUB_PYTHON3 = """#!/bin/sh
case "$1 $2" in
  "-m venv")
    mkdir -p "$3/bin"
    printf 'PATH="%s:$PATH"; export PATH\\n' "$STUB_VENV_BIN" > "$3/bin/activate" ;;
  *) echo "stub python3 $*" ;;
esac
"""
STUB_PIP = """#!/bin/sh
echo "stub pip $*"
exit "${STUB_PIP_STATUS:-0}"
"""
STUB_PYTHON = """#!/bin/sh
echo "stub python $*" >> "$STUB_LOG"
exit "${STUB_PYTEST_STATUS:-0}"
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def fake_clone(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    clone = tmp_path / "clone"
    (clone / ".ci").mkdir(parents=True)
    shutil.copy2(CI_RUN, clone / ".ci" / "run")
    (clone / ".venv").mkdir()
    (clone / ".venv" / "stale").write_text("from an earlier run")
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venvbin"
    bin_dir.mkdir()
    venv_bin.mkdir()
    _stub(bin_dir / "python3", STUB_PYTHON3)
    _stub(venv_bin / "pip", STUB_PIP)
    _stub(venv_bin / "python", STUB_PYTHON)
    # the image build for the docker tests is exercised by tests/docker, not here
    (clone / "docker").mkdir()
    _stub(clone / "docker" / "ci-setup.sh", '#!/bin/sh\necho "stub ci-setup" >> "$STUB_LOG.ci-setup"\n')
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STUB_VENV_BIN=str(venv_bin),
               STUB_LOG=str(tmp_path / "log"))
    return clone, env


def _run_ci(clone: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(clone / ".ci" / "run"), *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=clone)


@pytest.mark.parametrize(("pytest_status", "message"), [
    (0, "== CI passed"),
    (1, "== CI FAILED with exit code 1"),
    (5, "== CI FAILED: pytest collected no tests (exit code 5)"),
])
def test_ci_exit_status_follows_pytest(fake_clone: tuple[Path, dict[str, str]],
                                       pytest_status: int, message: str) -> None:
    clone, env = fake_clone
    env["STUB_PYTEST_STATUS"] = str(pytest_status)
    result = _run_ci(clone, env)
    assert result.returncode == pytest_status
    assert message in result.stdout + result.stderr
    assert result.stdout.startswith("== netdist CI\ncommit:  not a git checkout\n")
    assert "stub pip install -e .[test]" in result.stdout
    assert Path(env["STUB_LOG"]).read_text() == "stub python -m pytest\n"
    assert not (clone / ".venv" / "stale").exists()  # a fresh venv
    if shutil.which("docker", path=env["PATH"]):  # the docker image step runs first
        assert Path(env["STUB_LOG"] + ".ci-setup").read_text() == "stub ci-setup\n"


def test_ci_fails_when_install_fails_and_passes_arguments(
        fake_clone: tuple[Path, dict[str, str]]) -> None:
    clone, env = fake_clone
    result = _run_ci(clone, env, "tests/cli", "-x")
    assert result.returncode == 0
    assert Path(env["STUB_LOG"]).read_text() == "stub python -m pytest tests/cli -x\n"
    Path(env["STUB_LOG"]).unlink()
    env["STUB_PIP_STATUS"] = "3"
    result = _run_ci(clone, env)
    assert result.returncode == 3
    assert "== CI FAILED with exit code 3" in result.stderr
    assert not Path(env["STUB_LOG"]).exists()  # pytest never ran
