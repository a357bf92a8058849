"""Every example of the documentation runs, for real, and prints what the page says. The
documentation is README.md and every page of the MkDocs site in ``docs/`` (``docs/*.md``,
in name order, after the README); the examples' code is the files in ``examples/``.

Convention (stated on ``docs/development.md``, "Examples run as tests"):

- an example is one file, ``examples/NAME.py``, starting with ``# example: NAME.py``; an
  optional second line ``# run: COMMAND`` says how to start it (``netdist launch -n 2 --
  python NAME.py``, ...); without it the example runs as ``python NAME.py``;
- a docs page shows it with a fenced ``python`` block holding only the include marker
  ``--8<-- "examples/NAME.py"`` (``pymdownx.snippets`` puts the file there in the built
  site); README.md, which GitHub renders as it is, holds the code inline, and that block
  must be byte-identical to the file. Every fenced ``python`` block is an example; blocks
  that are not meant to run are fenced as ``text``. Every file in ``examples/`` is shown
  on exactly one page and listed, with its run command, in ``examples/README.md``;
- a ``text`` block that follows immediately (nothing but blank lines between) is the
  expected output: compared exactly for a plain ``python NAME.py``, and as a sorted list
  of lines for a launched job (ranks print concurrently, so their order varies);
- a ``console`` block is a shell session: ``$ COMMAND`` lines (``netdist`` or ``python``)
  each followed by exactly what the command prints; it runs in the directory the examples
  above it ran in.

The code that runs is always read from ``examples/`` (following a page's include marker),
and the README's inline copy is checked against it, so what a page shows, what the tests
run and what a user runs from ``examples/`` cannot drift apart. Example file names are
unique across all pages, so every example can be copied into one folder.

Each example runs in its own temporary directory with ``netdist`` and ``python`` in the
command replaced by this interpreter, with a bounded timeout. Multi-process examples are
marked ``slow``. Then the whole documentation (the README, then the pages) runs twice, in
order, in one directory, as a user who copies every example into one folder would:
examples and ``console`` commands, every output checked both times. An example may create
only a directory named after itself (``ckpt_job.py`` writes ``ckpt_job/``), so examples
cannot step on each other's files and each one runs again on what its first run left
behind (issue 12, item 17).
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
DOCS = REPO_ROOT / "docs"
EXAMPLES_DIR = REPO_ROOT / "examples"
EXAMPLES_README = EXAMPLES_DIR / "README.md"
TIMEOUT = 90.0
# the README's 18 examples (each with its expected output) before it was split into docs/
# pages (issue 17, item 7): moving text must never drop one
EXAMPLES_BEFORE_SPLIT = frozenset({
    "allreduce.py", "blocking.py", "ddp_netdist.py", "ddp_hooks.py", "sync_train.py",
    "ps_torch_train.py", "collectives.py", "timeouts.py", "dp_train.py", "dp_overlap.py",
    "topk.py", "ps_worker.py", "ckpt_job.py", "ckpt_torch.py", "reshard_demo.py",
    "fsdp_train.py", "pipe.py", "stages.py"})

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NAME = re.compile(r"^# example: ([A-Za-z_][A-Za-z0-9_]*\.py)$")
# a docs page's python block: nothing but the snippets include of one example file
_INCLUDE = re.compile(r'^--8<-- "examples/([A-Za-z_][A-Za-z0-9_]*\.py)"\n\Z')


@dataclass(frozen=True, slots=True)
class Example:
    name: str
    code: str  # the text of examples/NAME.py: what runs
    command: tuple[str, ...]
    expected: str | None
    line: int
    source: str = "README.md"
    shown: str = ""  # the block as the page holds it: inline code or the include marker
    run_line: str = ""  # the command as written, for examples/README.md

    @property
    def launched(self) -> bool:
        return len(self.command) > 1 and self.command[:2] == ("netdist", "launch")


@dataclass(frozen=True, slots=True)
class ConsoleCommand:
    """One ``$ COMMAND`` of a ``console`` block and the lines printed under it."""

    command: tuple[str, ...]
    expected: str
    line: int
    source: str = "README.md"


def doc_pages() -> list[Path]:
    """README.md, then every page of the docs site in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _console_commands(body: str, line_no: int, source: str) -> list[ConsoleCommand]:
    commands: list[ConsoleCommand] = []
    for offset, line in enumerate(body.splitlines(), start=line_no + 1):
        if line.startswith("$ "):
            command = tuple(shlex.split(line[2:]))
            if not command or command[0] not in ("netdist", "python"):
                raise AssertionError(f"{source} line {offset}: a console command must start "
                                     f"with netdist or python, got {line!r}")
            commands.append(ConsoleCommand(command, "", offset, source))
        elif not commands:
            raise AssertionError(f"{source} line {offset}: a console block must start "
                                 f"with '$ COMMAND', got {line!r}")
        else:
            last = commands[-1]
            commands[-1] = ConsoleCommand(last.command, last.expected + line + "\n", last.line,
                                          source)
    return commands


def _example_code(path: Path, source: str, body: str, line_no: int) -> tuple[str, str]:
    """The example a python block shows, and its code, read from ``examples/``: a docs
    page includes the file (``--8<-- "examples/NAME.py"``); the README, rendered as it is
    by GitHub, holds a copy inline (checked byte for byte by
    ``test_readme_blocks_are_their_example_files``)."""
    if path == README:
        match = _NAME.match(body.split("\n", 1)[0])
        if match is None:
            raise AssertionError(f"{source} line {line_no}: a python block must start with "
                                 f"'# example: NAME.py' (fence it as text if it is not code "
                                 f"to run)")
    else:
        match = _INCLUDE.match(body)
        if match is None:
            raise AssertionError(f"{source} line {line_no}: a python block on a docs page "
                                 f"holds only '--8<-- \"examples/NAME.py\"', the code lives "
                                 f"in examples/ (fence it as text if it is not code to run)")
    name = match.group(1)
    file = EXAMPLES_DIR / name
    if not file.is_file():
        raise AssertionError(f"{source} line {line_no}: {name} is shown but examples/{name} "
                             f"does not exist")
    return name, file.read_text(encoding="utf-8")


def _page_items(path: Path) -> list[Example | ConsoleCommand]:
    """One page's examples and console commands, in the order they appear."""
    source = path.relative_to(REPO_ROOT).as_posix()
    text = path.read_text(encoding="utf-8")
    blocks = list(_FENCE.finditer(text))
    items: list[Example | ConsoleCommand] = []
    for index, block in enumerate(blocks):
        body = block.group(2)
        line_no = text.count("\n", 0, block.start()) + 1
        if block.group(1) == "console":
            items += _console_commands(body, line_no, source)
            continue
        if block.group(1) != "python":
            continue
        name, code = _example_code(path, source, body, line_no)
        lines = code.splitlines()
        match = _NAME.match(lines[0]) if lines else None
        if match is None or match.group(1) != name:
            raise AssertionError(f"examples/{name} must start with '# example: {name}'")
        run_line = f"python {name}"
        command: tuple[str, ...] = ("python", name)
        if len(lines) > 1 and lines[1].startswith("# run: "):
            run_line = lines[1][len("# run: "):]
            command = tuple(shlex.split(run_line))
            if command[0] not in ("netdist", "python") or name not in command:
                raise AssertionError(f"examples/{name}: '# run:' must start with netdist or "
                                     f"python and run {name}, got {lines[1]!r}")
        expected = None
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if (following is not None and following.group(1) == "text"
                and not text[block.end():following.start()].strip()):
            expected = following.group(2)
        items.append(Example(name, code, command, expected, line_no, source, body,
                             run_line))
    return items


def _doc_items() -> list[Example | ConsoleCommand]:
    """Every page's examples and console commands: the README's, then each page's."""
    items = [item for page in doc_pages() for item in _page_items(page)]
    examples = [i for i in items if isinstance(i, Example)]
    names = [e.name for e in examples]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        where = {n: [f"{e.source} line {e.line}" for e in examples if e.name == n]
                 for n in duplicates}
        raise AssertionError(f"examples share file names: {where}")
    return items


DOC_ITEMS = _doc_items()
EXAMPLES = [item for item in DOC_ITEMS if isinstance(item, Example)]
CONSOLE = [item for item in DOC_ITEMS if isinstance(item, ConsoleCommand)]


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
    assert EXAMPLES_BEFORE_SPLIT <= names, sorted(EXAMPLES_BEFORE_SPLIT - names)
    assert len(EXAMPLES) >= len(EXAMPLES_BEFORE_SPLIT)
    # the README keeps its quickstart; the other examples live on the docs pages
    assert "allreduce.py" in {e.name for e in EXAMPLES if e.source == "README.md"}
    assert {"allreduce.py", "collectives.py", "dp_train.py", "ckpt_job.py", "fsdp_train.py",
            "pipe.py", "reshard_demo.py"} <= names
    assert all(e.expected is not None for e in EXAMPLES), \
        [e.name for e in EXAMPLES if e.expected is None]
    # the inspect output docs/checkpointing.md shows is checked against the real command
    assert ("netdist", "ckpt", "inspect", "ckpt_job") in {c.command for c in CONSOLE}


def test_readme_blocks_are_their_example_files() -> None:
    """GitHub shows README.md as it is, so its examples are inline copies: each one must be
    byte-identical to the file in examples/ that runs (the docs pages include the file)."""
    readme = [e for e in EXAMPLES if e.source == "README.md"]
    assert readme
    for example in readme:
        assert example.shown == example.code, (
            f"README.md line {example.line}: the {example.name} block differs from "
            f"examples/{example.name}; edit the file and copy it into the README")
    for example in EXAMPLES:
        if example.source != "README.md":
            assert example.shown == f'--8<-- "examples/{example.name}"\n', example


def test_every_example_file_is_shown_once_and_listed() -> None:
    """examples/ holds exactly the examples the pages show (none that no test runs), and
    examples/README.md lists each one with the command that runs it."""
    files = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
    assert files == sorted(e.name for e in EXAMPLES), (
        "examples/*.py not shown on any page: "
        f"{sorted(set(files) - {e.name for e in EXAMPLES})}")
    listing = EXAMPLES_README.read_text(encoding="utf-8")
    for example in EXAMPLES:
        assert f"[`{example.name}`]({example.name})" in listing, (
            f"examples/README.md does not list {example.name}")
        assert f"`{example.run_line}`" in listing, (
            f"examples/README.md lacks {example.name}'s run command `{example.run_line}`")


def _run(command: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(command), cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


def _check_output(item: Example | ConsoleCommand, result: subprocess.CompletedProcess[str],
                  when: str = "") -> None:
    """The run exited 0 and printed what its page shows (sorted lines for a launch)."""
    where = f"{item.source} line {item.line}: {' '.join(item.command)}{when}"
    assert result.returncode == 0, (
        f"{where} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    if item.expected is None:
        return
    got = result.stdout.rstrip("\n").splitlines()
    want = item.expected.rstrip("\n").splitlines()
    if isinstance(item, Example) and item.launched:
        got, want = sorted(got), sorted(want)
    assert got == want, f"{where} printed something else\nstderr:\n{result.stderr}"


@pytest.mark.parametrize("example", [
    pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.launched else [])
    for e in EXAMPLES
])
def test_readme_example_runs(example: Example, tmp_path: Path) -> None:
    (tmp_path / example.name).write_text(example.code, encoding="utf-8")
    _check_output(example, _run(example.command, tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_runs_twice_in_order_in_one_directory(tmp_path: Path) -> None:
    """A user copies every example into one folder and runs the README and then every docs
    page top to bottom, then once more: every example and console command prints what its
    page shows both times, and each example creates nothing but the directory named after
    it."""
    for example in EXAMPLES:
        (tmp_path / example.name).write_text(example.code, encoding="utf-8")
    for run in ("first", "second"):
        when = f" (docs run in order, {run} time)"
        for item in DOC_ITEMS:
            before = set(os.listdir(tmp_path))
            result = _run(item.command, tmp_path)
            _check_output(item, result, when)
            created = set(os.listdir(tmp_path)) - before
            allowed = {Path(item.name).stem} if isinstance(item, Example) else set()
            assert created <= allowed, (
                f"{item.source} line {item.line}: {' '.join(item.command)} created {sorted(created)}"
                f"{when}; an example may create only the directory named after it")
