"""``netdist ckpt``: one-line usage errors with exit code 2, no writing into the source,
and progress output that suits its destination (issue 12, items 7, 15 and 16)."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import (
    flat_shard_metadata,
    save_distributed,
    shard_state_dict,
    verify_checkpoint,
)
from netdist.cli.ckpt import _ProgressLine, _size
from netdist.cli.main import main

pytestmark = pytest.mark.timeout(120)

# w's 256 KiB shard fills more than one 256 KiB checksum block of rank 1's file, so a
# flipped last byte fails the read of w only, after v was consolidated (and reported)
FULL: dict[str, np.ndarray] = {
    "w": np.arange(4096 * 32, dtype=np.float32).reshape(4096, 32),
    "v": np.arange(40, dtype=np.float64),
}
TOTAL = _size(sum(a.nbytes for a in FULL.values()))
RUN_TIMEOUT = 60.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root holding ``step_000003`` (2 ranks)."""
    meta = flat_shard_metadata(FULL, 2)
    for rank in range(2):
        save_distributed(shard_state_dict(FULL, meta, rank), tmp_path / "ck", rank, 2, meta,
                         step=3)
    return tmp_path / "ck"


def _run(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NETDIST_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "netdist", "ckpt", *argv], text=True,
                          capture_output=True, timeout=RUN_TIMEOUT, env=env, **kwargs)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


# --------------------------------------------------------------------------- item 15


def test_consolidate_into_a_missing_directory_is_one_line_exit_2(root: Path,
                                                                 tmp_path: Path) -> None:
    result = _run("consolidate", str(root), str(tmp_path / "nowhere" / "all.safetensors"))
    assert result.returncode == 2
    assert result.stderr == (f"netdist ckpt: error: output directory {tmp_path / 'nowhere'} "
                             f"does not exist\n")
    assert result.stdout == ""
    assert not (tmp_path / "nowhere").exists()


def test_consolidate_onto_a_directory_is_one_line_exit_2(root: Path, tmp_path: Path,
                                                         capsys: Any) -> None:
    (tmp_path / "out").mkdir()
    assert main(["ckpt", "consolidate", str(root), str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"netdist ckpt: error: output {tmp_path / 'out'} is a directory; "
                            f"give a file name such as {tmp_path / 'out' / 'model.safetensors'}\n")
    assert list((tmp_path / "out").iterdir()) == []


def test_consolidate_into_the_checkpoint_itself_is_refused(root: Path, capsys: Any) -> None:
    before = _snapshot(root)
    out = root / "step_000003" / "rank_00000.safetensors"
    assert main(["ckpt", "consolidate", str(root), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is inside the checkpoint" in err
    assert _snapshot(root) == before


def test_consolidate_write_error_is_a_checkpoint_error(root: Path, tmp_path: Path,
                                                       capsys: Any) -> None:
    # a directory nobody can create files in (root ignores permission bits, not /proc)
    locked = Path("/proc") if os.geteuid() == 0 else tmp_path / "locked"
    if locked != Path("/proc"):
        locked.mkdir(mode=0o500)
    assert main(["ckpt", "consolidate", str(root), str(locked / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"netdist ckpt: error: cannot write {locked / 'x.safetensors'}: ")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("target", ["root", "step", "inside", "holder"])
def test_reshard_into_its_own_source_is_refused(root: Path, target: str) -> None:
    source = root if target != "holder" else root / "step_000003"
    out = {"root": root, "step": root / "step_000003", "inside": root / "step_000003" / "new",
           "holder": root}[target]
    before = _snapshot(root)
    result = _run("reshard", str(source), "--world-size", "3", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("netdist ckpt: error: ")
    assert "Traceback" not in result.stderr
    assert "inside the source" in result.stderr or "the root that holds" in result.stderr
    assert _snapshot(root) == before
    report = verify_checkpoint(root)
    assert report.ok and report.files == 2


def test_reshard_to_a_sibling_still_works(root: Path, tmp_path: Path) -> None:
    result = _run("reshard", str(root), "--world-size", "3", str(tmp_path / "ck3"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {tmp_path / 'ck3'}: 3 ranks, 2 tensors\n"
    assert verify_checkpoint(tmp_path / "ck3").files == 3


def test_verify_with_a_fifo_shard_reports_it(root: Path) -> None:
    shard = root / "step_000003" / "rank_00001.safetensors"
    os.unlink(shard)
    os.mkfifo(shard)
    result = _run("verify", str(root))
    assert result.returncode == 1
    assert f"  {shard} is a FIFO, not a regular file\n" in result.stdout


# --------------------------------------------------------------------------- item 16


def test_progress_to_a_pipe_is_whole_lines(root: Path, tmp_path: Path) -> None:
    result = _run("consolidate", str(root), str(tmp_path / "all.safetensors"))
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines(keepends=True)
    assert lines and all(line.endswith("\n") for line in lines)
    assert all(line.startswith("consolidate: ") for line in lines)
    assert lines[-1].startswith(f"consolidate: {TOTAL} / {TOTAL} (100.0%)  ")
    assert lines[-1].endswith(" s\n")


def test_progress_to_a_file_error_on_its_own_line(root: Path, tmp_path: Path) -> None:
    shard = root / "step_000003" / "rank_00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(raw)
    with open(tmp_path / "err.txt", "w") as err:
        result = subprocess.run(
            [sys.executable, "-m", "netdist", "ckpt", "consolidate", str(root),
             str(tmp_path / "all.safetensors")], stdout=subprocess.PIPE, stderr=err,
            text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 1
    text = (tmp_path / "err.txt").read_text()
    assert "\r" not in text
    last = text.splitlines()[-1]
    assert last.startswith(f"netdist ckpt: error: {shard}: checksum mismatch")
    assert all(line.startswith("consolidate: ") for line in text.splitlines()[:-1])


def test_progress_lines_off_a_terminal_are_sparse_whole_lines() -> None:
    now = [0.0]
    stream = io.StringIO()
    with _ProgressLine("verify", stream, clock=lambda: now[0], log_interval=5.0) as progress:
        for step in range(1, 101):  # 100 updates, 1 s apart
            now[0] = float(step)
            progress(step * 1024, 100 * 1024)
        progress.finish()
    lines = stream.getvalue().splitlines(keepends=True)
    assert "\r" not in stream.getvalue()
    assert [line.split("(")[1].split(")")[0] for line in lines[:-1]] == [
        f"{pct:5.1f}%" for pct in range(5, 100, 5)]
    assert lines[-1] == "verify: 100.0 KiB / 100.0 KiB (100.0%)  100.0 s\n"


def test_progress_line_is_ended_before_an_error() -> None:
    stream = io.StringIO()
    with pytest.raises(RuntimeError):
        with _ProgressLine("verify", stream, interactive=True) as progress:
            progress(10, 100)
            raise RuntimeError("boom")
    assert stream.getvalue() == "\rverify: 10 B / 100 B ( 10.0%)\n"


def _read_pty(master: int) -> Iterator[bytes]:
    while True:
        ready, _, _ = select.select([master], [], [], RUN_TIMEOUT)
        if not ready:
            raise TimeoutError("no output from the pty")
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the other side is closed and everything was read
            return
        if not chunk:
            return
        yield chunk


@pytest.mark.parametrize("corrupt", [False, True])
def test_progress_on_a_terminal_redraws_and_errors_start_a_line(root: Path, tmp_path: Path,
                                                                corrupt: bool) -> None:
    if corrupt:
        shard = root / "step_000003" / "rank_00001.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF
        shard.write_bytes(raw)
    master, slave = os.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "netdist", "ckpt", "consolidate", str(root),
             str(tmp_path / "all.safetensors")], stdout=subprocess.DEVNULL, stderr=slave,
            env={**os.environ, "NETDIST_DEBUG": ""})
        os.close(slave)
        slave = -1
        output = b"".join(_read_pty(master)).decode()
        assert process.wait(timeout=RUN_TIMEOUT) == (1 if corrupt else 0)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    text = output.replace("\r\n", "\n")  # the terminal's own newline translation
    assert "\rconsolidate: " in text  # redrawn in place
    lines = text.split("\n")
    if corrupt:
        assert lines[-2].startswith("netdist ckpt: error: ")
        assert "checksum mismatch" in lines[-2]
        assert lines[-3].startswith("\rconsolidate: ")  # the progress line was ended first
    else:
        frames = lines[-2].split("\r")
        assert frames[0] == "" and len(frames) >= 3
        assert frames[-1].startswith(f"consolidate: {TOTAL} / {TOTAL} (100.0%)  ")
        assert frames[-1].endswith(" s") and lines[-1] == ""
