"""Restart trials: does ``torchrun --max-restarts 2`` bring a DDP job back after a SIGKILL,
on the first restart?

Each trial runs, on 127.0.0.1 with a free port,

    torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --local-addr 127.0.0.1 \\
        examples/ecosystem/torchrun_train.py OUT --pause-after 2

(``--rdzv standalone``: ``--standalone`` instead of the c10d flags; ``--rdzv static``:
``--master-addr 127.0.0.1 --master-port PORT``). The script trains a tiny DDP model on
the ``netdist`` backend (``--backend gloo`` runs the same job on Gloo) and saves a DCP
checkpoint after every step; in attempt 0, rank 1 writes ``OUT/paused.json`` once step
2's checkpoint is complete, and the trial SIGKILLs it on that file. torchrun restarts
the group; the restarted ranks resume from the last complete checkpoint and finish.

A trial *recovered on the first restart* when torchrun exits 0, every rank finished in
attempt 1 (``TORCHELASTIC_RESTART_COUNT`` as the ranks recorded it), resumed after step 2,
the final weights are bitwise those of an uninterrupted run of the same script (run
once first, without ``--pause-after``), and in each attempt every rank met at that
attempt's own netdist coordinator: the store record each rank read names its attempt,
all ranks of an attempt read the same record (address and nonce), and attempt 1's
nonce is not attempt 0's (no rank used an earlier attempt's address).

    python benchmarks/torchrun_restarts.py                     # 10 trials, c10d rendezvous
    python benchmarks/torchrun_restarts.py --rdzv standalone --trials 3
    python benchmarks/torchrun_restarts.py --backend gloo      # the same job on Gloo

Prints one line per trial and ``recovered on the first restart: K/N``; exits 1 unless
every trial recovered. ``tests/torch/test_torchrun_restarts.py`` runs ``run_job`` and
``problems`` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "ecosystem" / "torchrun_train.py"
RDZV_MODES = ("c10d", "standalone", "static")
PAUSE_AFTER = 2
STEPS = 6
JOB_TIMEOUT = 240.0
"""Bound on one torchrun job (two attempts of two ranks, each importing torch)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_argv(rdzv: str, port: int, out: Path, *script_args: str) -> list[str]:
    """The torchrun command line of one job (``python -m torch.distributed.run``)."""
    each = ["--nproc-per-node", "2", "--max-restarts", "2"]
    if rdzv == "c10d":
        mode = ["--nnodes", "1", *each, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"]
    elif rdzv == "standalone":
        mode = ["--standalone", *each, "--local-addr", "127.0.0.1"]
    elif rdzv == "static":
        mode = ["--nnodes", "1", *each, "--master-addr", "127.0.0.1", "--master-port",
                str(port)]
    else:
        raise ValueError(f"rendezvous mode {rdzv!r} is not one of {RDZV_MODES}")
    return [sys.executable, "-m", "torch.distributed.run", *mode, str(TRAIN), str(out),
            *script_args]


def job_env(out: Path) -> dict[str, str]:
    """This environment without any launcher's variables, the repository importable,
    temporary files (torchrun's log folders) under ``out``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "TORCHELASTIC_", "OMPI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TMPDIR=str(out / "tmp"))
    return env


@dataclass
class JobResult:
    """What one torchrun job did, as its ranks recorded it under ``out``."""

    out: Path
    returncode: int | None
    seconds: float
    killed_pid: int | None = None
    finals: list[dict[str, Any]] = field(default_factory=list)
    joined: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    def log(self) -> str:
        """torchrun's output (its own and every rank's)."""
        path = self.out / "torchrun.log"
        return path.read_text(errors="replace") if path.is_file() else ""


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait until ``path`` exists (True), the job exits or the deadline passes (False)."""
    pause = 0.005
    while not path.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(pause)  # polling for the file (the event), not for time to pass
        pause = min(pause * 2, 0.05)
    return True


def _read_json(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(paths)]


def run_job(out: Path, *, rdzv: str = "c10d", backend: str = "netdist",
            pause_after: int | None = PAUSE_AFTER, steps: int = STEPS,
            timeout: float = JOB_TIMEOUT) -> JobResult:
    """Run one torchrun job into ``out``; with ``pause_after``, SIGKILL rank 1 of attempt 0
    once it says (``paused.json``) that step ``pause_after``'s checkpoint is complete."""
    out.mkdir(parents=True, exist_ok=True)
    extra = [] if steps == STEPS else ["--steps", str(steps)]  # the script's defaults:
    extra += [] if backend == "netdist" else ["--backend", backend]  # the docs' command
    if pause_after is not None:
        extra += ["--pause-after", str(pause_after)]
    argv = torchrun_argv(rdzv, free_port(), out, *extra)
    start = time.monotonic()
    deadline = start + timeout
    result = JobResult(out, None, 0.0)
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=job_env(out), start_new_session=True)
        try:
            if pause_after is not None:
                paused = out / "paused.json"
                if _wait_for_file(paused, proc, deadline):
                    result.killed_pid = int(json.loads(paused.read_text())["pid"])
                    os.kill(result.killed_pid, signal.SIGKILL)
                else:
                    result.error = f"rank 1 never paused after step {pause_after}"
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            result.error = f"torchrun did not finish within {timeout:.0f} s"
        finally:
            if proc.poll() is None:  # torchrun and its workers: the session we started
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    result.returncode = proc.returncode
    result.seconds = time.monotonic() - start
    result.finals = _read_json(list(out.glob("final-rank-*.json")))
    result.joined = _read_json(list((out / "joined").glob("attempt-*-rank-*.json")))
    return result


def problems(result: JobResult, reference: JobResult | None, *, world: int = 2,
             restarts: int = 1, pause_after: int | None = PAUSE_AFTER) -> list[str]:
    """Why ``result`` is not a job that finished after exactly ``restarts`` restarts with
    the reference's weights and every rank meeting at its own attempt's coordinator
    (empty when it is)."""
    found: list[str] = []
    if result.error:
        found.append(result.error)
    if result.returncode != 0:
        found.append(f"torchrun exited {result.returncode}")
    ranks = sorted(f["rank"] for f in result.finals)
    if ranks != list(range(world)):
        found.append(f"final weights from ranks {ranks}, not 0..{world - 1}")
    attempts = sorted({f["attempt"] for f in result.finals})
    if result.finals and attempts != [restarts]:
        found.append(f"finished in attempt(s) {attempts} (TORCHELASTIC_RESTART_COUNT), "
                     f"not {restarts}")
    if len({f["weights"] for f in result.finals}) > 1:
        found.append("ranks finished with different weights")
    if reference is not None and reference.finals and result.finals and \
            result.finals[0]["weights"] != reference.finals[0]["weights"]:
        found.append("final weights differ from the uninterrupted run's")
    if restarts and pause_after is not None:
        resumed = sorted({j["resumed_after"] for j in result.joined if j["attempt"] == restarts})
        if resumed != [pause_after]:
            found.append(f"attempt {restarts} resumed after step(s) {resumed}, "
                         f"not {pause_after}")
    found += _met_problems(result.joined, world, restarts)
    return found


def _met_problems(joined: list[dict[str, Any]], world: int, restarts: int) -> list[str]:
    """Every rank of every attempt read its own attempt's coordinator record."""
    found: list[str] = []
    nonces: dict[int, str] = {}
    for attempt in range(restarts + 1):
        rows = [j for j in joined if j["attempt"] == attempt]
        if sorted(j["rank"] for j in rows) != list(range(world)):
            found.append(f"attempt {attempt}: joined records from ranks "
                         f"{sorted(j['rank'] for j in rows)}")
            continue
        records = [j["record"] for j in rows]
        if any(r is None for r in records):
            continue  # not netdist: there is no store record to check
        for rank, record in ((j["rank"], j["record"]) for j in rows):
            if record["restart_count"] != attempt:
                found.append(f"attempt {attempt}: rank {rank} met at the coordinator of "
                             f"attempt {record['restart_count']} ({record['address']}): "
                             "a stale address")
        if len({(r["address"], r["nonce"], r["generation"]) for r in records}) != 1:
            found.append(f"attempt {attempt}: ranks read different coordinator records "
                         f"{records}")
        nonces[attempt] = records[0]["nonce"]
    if len(set(nonces.values())) != len(nonces):
        found.append(f"two attempts shared a coordinator record (nonces {nonces})")
    return found


def error_lines(log: str, most: int = 6) -> list[str]:
    """The distinct exception lines of a job's log (``SomeError: message``), first first."""
    seen: dict[str, None] = {}
    for line in log.splitlines():
        match = re.search(r"\b\w+(Error|Exception|Timeout)\b: .*", line)
        if match:
            seen.setdefault(match.group(0)[:300])
    return list(seen)[:most]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rdzv", choices=RDZV_MODES, default="c10d",
                        help="torchrun's rendezvous: c10d with an endpoint (default), "
                             "--standalone, or static (--master-addr/--master-port)")
    parser.add_argument("--backend", default="netdist", help="netdist (default) or gloo")
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT,
                        help="bound on each torchrun job, seconds")
    parser.add_argument("--dir", default=None, help="where the jobs write (a temporary "
                        "directory under it, removed at the end)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="torchrun-restarts-", dir=args.dir) as tmp:
        root = Path(tmp)
        reference = run_job(root / "reference", rdzv=args.rdzv, backend=args.backend,
                            pause_after=None, timeout=args.timeout)
        failed = problems(reference, None, restarts=0, pause_after=None)
        print(f"uninterrupted run: {STEPS} steps in {reference.seconds:.1f} s"
              + (f"; FAILED: {'; '.join(failed)}" if failed else ""), flush=True)
        if failed:
            print(reference.log()[-4000:])
            return 1
        recovered = 0
        for trial in range(1, args.trials + 1):
            result = run_job(root / f"trial-{trial}", rdzv=args.rdzv, backend=args.backend,
                             timeout=args.timeout)
            found = problems(result, reference)
            recovered += not found
            verdict = ("recovered on the first restart, weights bitwise equal"
                       if not found else "FAILED: " + "; ".join(found))
            print(f"trial {trial:2d}: {result.seconds:5.1f} s  {verdict}", flush=True)
            if found:
                for line in error_lines(result.log()):
                    print(f"  {line}", flush=True)
        print(f"recovered on the first restart: {recovered}/{args.trials} "
              f"({args.backend}, torchrun rendezvous {args.rdzv})")
    return 0 if recovered == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
