"""Every ``python`` code block in README.md runs, for real, and prints what the README says.

Convention (stated in the README's "Examples in this README" note):

- every fenced ``python`` block starts with ``# example: NAME.py``; blocks that are not
  meant to run are fenced as ``text``;
- an optional second line ``# run: COMMAND`` says how to start it (``netdist launch -n 2
  -- python NAME.py``, ...); without it the block runs as ``python NAME.py``;
- a ``text`` block that follows immediately (nothing but blank lines between) is the
  expected output: compared exactly for a plain ``python NAME.py``, and as a sorted list
  of lines for a launched job (ranks print concurrently, so their order varies).

Each example runs in its own temporary directory with ``netdist`` and ``python`` in the
command replaced by this interpreter, with a bounded timeout. Multi-process examples are
marked ``slow``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
TIMEOUT = 90.0

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NAME = re.compile(r"^# example: ([A-Za-z_][A-Za-z0-9_]*\.py)$")


@dataclass(frozen=True, slots=True)
class Example:
    name: str
    code: str
    command: tuple[str, ...]
    expected: str | None
    line: int

    @property
    def launched(self) -> bool:
        return len(self.command) > 1 and self.command[:2] == ("netdist", "launch")


def _examples() -> list[Example]:
    text = README.read_text(encoding="utf-8")
    blocks = list(_FENCE.finditer(text))
    examples: list[Example] = []
    for index, block in enumerate(blocks):
        if block.group(1) != "python":
            continue
        body = block.group(2)
        lines = body.splitlines()
        line_no = text.count("\n", 0, block.start()) + 1
        match = _NAME.match(lines[0]) if lines else None
        if match is None:
            raise AssertionError(f"README.md line {line_no}: a python block must start with "
                                 f"'# example: NAME.py' (fence it as text if it is not code "
                                 f"to run)")
        name = match.group(1)
        command: tuple[str, ...] = ("python", name)
        if len(lines) > 1 and lines[1].startswith("# run: "):
            command = tuple(shlex.split(lines[1][len("# run: "):]))
            if command[0] not in ("netdist", "python") or name not in command:
                raise AssertionError(f"README.md line {line_no}: '# run:' must start with "
                                     f"netdist or python and run {name}, got {lines[1]!r}")
        expected = None
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if (following is not None and following.group(1) == "text"
                and not text[block.end():following.start()].strip()):
            expected = following.group(2)
        examples.append(Example(name, body, command, expected, line_no))
    names = [e.name for e in examples]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise AssertionError(f"README examples share file names: {duplicates}")
    return examples


EXAMPLES = _examples()


def _argv(command: tuple[str, ...]) -> list[str]:
    argv: list[str] = []
    for word in command:
        if word == "netdist":
            argv += [sys.executable, "-m", "netdist"]
        elif word == "python":
            argv.append(sys.executable)
        else:
            argv.append(word)
    return argv


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "SLURM_", "OMPI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["NETDIST_TIMEOUT"] = "30"
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def test_readme_has_examples() -> None:
    names = {e.name for e in EXAMPLES}
    assert len(EXAMPLES) >= 8
    assert {"allreduce.py", "collectives.py", "dp_train.py", "ckpt_job.py", "fsdp_train.py",
            "pipe.py"} <= names
    assert all(e.expected is not None for e in EXAMPLES), \
        [e.name for e in EXAMPLES if e.expected is None]


@pytest.mark.parametrize("example", [
    pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.launched else [])
    for e in EXAMPLES
])
def test_readme_example_runs(example: Example, tmp_path: Path) -> None:
    (tmp_path / example.name).write_text(example.code, encoding="utf-8")
    result = subprocess.run(_argv(example.command), cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=TIMEOUT)
    where = f"README.md line {example.line}: {' '.join(example.command)}"
    assert result.returncode == 0, (
        f"{where} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    if example.expected is None:
        return
    got = result.stdout.rstrip("\n").splitlines()
    want = example.expected.rstrip("\n").splitlines()
    if example.launched:
        got, want = sorted(got), sorted(want)
    assert got == want, f"{where} printed something else\nstderr:\n{result.stderr}"
