"""Crash trials: SIGKILL both ranks of a checkpointing job at random moments of a save.

Each trial starts a job of 2 real processes over TCP on 127.0.0.1 that resumes from the
checkpoint root (collective ``load``, checked byte for byte against the values the
saved step and version determine) and then saves over and over (collective ``save``,
``keep_last=2``): in ``overwrite`` mode the same step again with ``overwrite=True`` (the
case where the old checkpoint must survive until the new one is committed), in
``default`` mode the next step. Once the job has begun a save, both ranks are SIGKILLed
after a random delay of up to 1.25 x the time one save takes, so kills land in every
phase: writing the shards, writing the metadata, renaming, updating ``latest``,
rotating. After each kill the root must hold a loadable checkpoint (every block verified
against its CRC) whose tensors are byte-exact for its step and version, no older than the
last save the job reported, and the next trial's job must resume from it and save
forward.

    python benchmarks/checkpoint_crash.py                            # 30 + 30 trials, 300 MiB
    python benchmarks/checkpoint_crash.py --trials 5 --mib 16 --mode overwrite

Prints, per mode, ``loadable & byte-exact: K/N``, how many kills found the save they
interrupted committed or not, and how many restarts resumed from the newest checkpoint
and saved forward; exits 1 if any trial failed. Files go to a temporary directory under
``--dir`` and are removed at the end. The worker role (``worker ...``) is also used by
``tests/checkpoint/test_commit_crash.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

WORLD = 2
COLS = 4096
KEEP_LAST = 2
OP_TIMEOUT = 60.0
MODES = ("overwrite", "default")


# ---------------------------------------------------------------------------- the data


def rows_for(mib: float) -> int:
    """Rows of each of the two uint32 tensors so that both hold ``mib`` MiB together."""
    return max(WORLD, int(mib * 2**20) // (2 * COLS * 4))


def _key(step: int, version: int) -> int:
    return (version * 2654435761 + step * 40503 + 1) & 0xFFFFFFFF


def shard(step: int, version: int, mib: float, rank: int, world: int) -> dict[str, Any]:
    """``rank``'s rows of tensors ``a`` and ``b``: unique per position, step and version."""
    import numpy as np

    from netdist.sharding import chunk_bounds

    lo, hi = chunk_bounds(rows_for(mib), world)[rank]
    positions = np.arange(lo * COLS, hi * COLS, dtype=np.uint32).reshape(hi - lo, COLS)
    key = _key(step, version)
    return {"a": positions ^ np.uint32(key), "b": positions ^ np.uint32(key ^ 0x5BD1E995),
            "bias": np.full(64, key, np.uint32)}


def state(step: int, version: int, mib: float, rank: int, world: int) -> dict[str, Any]:
    """The nested training state one rank saves."""
    from netdist.checkpoint import ShardedArray

    local = shard(step, version, mib, rank, world)
    return {"model": {"a": ShardedArray(local["a"]), "b": ShardedArray(local["b"]),
                      "bias": local["bias"]},
            "step": step, "version": version}


# ---------------------------------------------------------------------------- worker


async def _job(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.checkpoint import list_checkpoints, load, save
    from netdist.collectives import Group
    from netdist.config import DistributedConfig
    from netdist.transport.bootstrap import init

    config = DistributedConfig(rank=args.rank, world_size=WORLD,
                               coordinator=("127.0.0.1", args.port), token=args.token,
                               job_id="ckpt-crash", timeout=OP_TIMEOUT)
    async with init(config) as transport, Group(transport, timeout=OP_TIMEOUT) as group:
        rank = group.rank
        found = await group.broadcast_object(
            bool(list_checkpoints(args.root)) if rank == 0 else None, 0)
        step, version = 0, 0
        if found:
            loaded = await load(args.root, group, timeout=OP_TIMEOUT)
            step, version = int(loaded["step"]), int(loaded["version"])
            expected = shard(step, version, args.mib, rank, WORLD)
            got = {"a": loaded["model"]["a"].data, "b": loaded["model"]["b"].data,
                   "bias": loaded["model"]["bias"]}
            for name, array in expected.items():
                if not np.array_equal(got[name], array):
                    print(f"MISMATCH {name} of step {step} version {version}", flush=True)
                    raise SystemExit(1)
        print(f"resumed {step} {version}", flush=True)
        saved = 0
        while not args.saves or saved < args.saves:
            saved += 1
            target = step if args.mode == "overwrite" and step > 0 else step + 1
            version += 1
            local = state(target, version, args.mib, rank, WORLD)
            limit = _exhaust_descriptors() if rank == args.nofile_rank else None
            print(f"saving {target} {version}", flush=True)
            try:
                await save(local, args.root, group, step=target, keep_last=KEEP_LAST,
                           overwrite=args.mode == "overwrite", timeout=OP_TIMEOUT)
            finally:
                if limit is not None:
                    import resource

                    resource.setrlimit(resource.RLIMIT_NOFILE, limit)
            print(f"committed {target} {version}", flush=True)
            step = target


def _exhaust_descriptors() -> tuple[int, int]:
    """Lower RLIMIT_NOFILE so that the next open() fails with EMFILE; return the old limit.

    The limit is the lowest free descriptor number: every number below it is in use, so
    no new descriptor fits (the sockets already open keep working).
    """
    import resource

    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, old[1]))
    return old


def worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="checkpoint_crash.py worker")
    parser.add_argument("--root", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--mib", type=float, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--saves", type=int, default=0, help="0: save until killed")
    parser.add_argument("--nofile-rank", type=int, default=-1,
                        help="this rank runs out of file descriptors during its saves")
    args = parser.parse_args(argv)
    from netdist.cli.loop import run

    try:
        run(_job(args))
    except Exception as exc:  # reported to the driver, which decides
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return 3
    return 0


# ---------------------------------------------------------------------------- driver


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_job(root: str, mode: str, mib: float, *, saves: int = 0, nofile_rank: int = -1,
              rank0_env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Start both ranks of a job; stdout and stderr are piped together, line-buffered."""
    port, token = _free_port(), secrets.token_hex(16)
    base = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
    base.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(WORLD):
        env = dict(base, **(rank0_env or {})) if rank == 0 else dict(base)
        procs.append(subprocess.Popen(
            [sys.executable, HERE, "worker", "--root", root, "--rank", str(rank), "--port",
             str(port), "--token", token, "--mib", str(mib), "--mode", mode, "--saves",
             str(saves), "--nofile-rank", str(nofile_rank)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO))
    return procs


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next line ``proc`` prints ("" at end of output); raises after ``deadline``."""
    if proc.stdout is None:
        raise ValueError("the process's stdout is not piped")
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
    if not ready:
        raise TimeoutError("the job printed nothing in time")
    return proc.stdout.readline()


def wait_for(proc: subprocess.Popen[str], prefix: str, timeout: float) -> tuple[str, list[str]]:
    """Read lines until one starts with ``prefix``; return it and the lines before it."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        line = read_line(proc, deadline)
        if not line:
            raise RuntimeError(f"the job ended before {prefix!r}:\n{''.join(seen)}")
        if line.startswith(prefix):
            return line, seen
        seen.append(line)


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process (killing all after ``timeout``); ``(returncode, output)``."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate(timeout=30)
        results.append((proc.returncode, out))
    return results


def run_job(root: str, mode: str, mib: float, *, saves: int, nofile_rank: int = -1,
            rank0_env: dict[str, str] | None = None, timeout: float = 300.0
            ) -> list[tuple[int, str]]:
    """Run a job of ``saves`` saves to the end; ``(returncode, output)`` per rank."""
    return finish(spawn_job(root, mode, mib, saves=saves, nofile_rank=nofile_rank,
                            rank0_env=rank0_env), timeout)


def parse_events(output: str, event: str) -> list[tuple[int, int]]:
    """Every ``(step, version)`` the job printed after ``event`` (``committed``, ...)."""
    found = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == event:
            found.append((int(parts[1]), int(parts[2])))
    return found


def check_root(root: str, mib: float) -> tuple[int, int]:
    """Load the newest checkpoint of ``root`` as every rank (CRC of every block checked)
    and compare it byte for byte; return its ``(step, version)``. Raises on any defect."""
    import numpy as np

    from netdist.checkpoint import load_distributed, load_metadata

    meta = load_metadata(root)
    if meta.state is None:
        raise AssertionError("the checkpoint has no state layout")
    step, version = int(meta.state.objects["step"]), int(meta.state.objects["version"])
    if meta.step != step:
        raise AssertionError(f"metadata step {meta.step}, saved state says {step}")
    for rank in range(WORLD):
        got = load_distributed(root, rank, WORLD)
        want = shard(step, version, mib, rank, WORLD)
        for name, saved in (("a", "model.a"), ("b", "model.b"), ("bias", "model.bias")):
            if not np.array_equal(got[saved], want[name]):
                raise AssertionError(f"rank {rank}'s {saved} differs from step {step} "
                                     f"version {version}")
    return step, version


@dataclass
class Tally:
    """Outcomes of one mode's trials."""

    trials: int = 0
    exact: int = 0
    old: int = 0
    new: int = 0
    forward: int = 0
    failures: list[str] = field(default_factory=list)


def trial(root: str, mode: str, mib: float, delay: float, committed: tuple[int, int],
          tally: Tally, rng: random.Random) -> tuple[int, int]:
    """One job, killed ``delay`` s into its first save; returns the newest checkpoint's
    ``(step, version)`` (what the next job must resume from)."""
    procs = spawn_job(root, mode, mib)
    tally.trials += 1
    failure: Exception | None = None
    try:
        resumed, _ = wait_for(procs[0], "resumed", OP_TIMEOUT * 2)
        started, _ = wait_for(procs[0], "saving", OP_TIMEOUT)
        time.sleep(delay)  # the kill lands at a random moment of the save
        for proc in rng.sample(procs, len(procs)):
            proc.send_signal(signal.SIGKILL)
    except (RuntimeError, TimeoutError) as exc:  # no resume (a mismatch) or no save
        failure = exc
        for proc in procs:
            proc.kill()
    finally:
        results = finish(procs, 60)
    if failure is not None:
        outputs = "".join(out for _, out in results)
        tally.failures.append(f"the job did not resume and save: {failure}\n{outputs}")
        return committed
    out = resumed + started + results[0][1]
    was = parse_events(resumed, "resumed")[0]
    saving = parse_events(out, "saving")
    forward = saving[0][0] == was[0] if mode == "overwrite" else saving[0][0] > was[0]
    if was != committed or not forward or "error " in out:
        tally.failures.append(f"the job resumed from {was} (newest: {committed}) and began "
                              f"saving {saving[0]}:\n{out}")
    else:
        tally.forward += 1
    done = parse_events(out, "committed")
    newest = done[-1] if done else committed
    try:
        got = check_root(root, mib)
    except Exception as exc:  # counted, reported at the end
        tally.failures.append(f"not loadable after the kill: {type(exc).__name__}: {exc}")
        return newest
    if got != newest and got not in saving:
        tally.failures.append(f"loaded {got}; last committed {newest}, saving {saving}")
    elif got[1] < newest[1]:
        tally.failures.append(f"loaded {got}, older than the committed {newest}")
    else:
        tally.exact += 1
        if got == newest:
            tally.old += 1
        else:
            tally.new += 1
    return got


def time_one_save(root: str, mode: str, mib: float) -> tuple[tuple[int, int], float]:
    """Run a job of two saves (the first creates the checkpoint the trials start from);
    return the last ``(step, version)`` committed and how long the second save took."""
    procs = spawn_job(root, mode, mib, saves=2)
    try:
        wait_for(procs[0], "committed", OP_TIMEOUT * 2)
        wait_for(procs[0], "saving", OP_TIMEOUT)
        started = time.monotonic()
        line, _ = wait_for(procs[0], "committed", OP_TIMEOUT * 2)
        seconds = time.monotonic() - started
    finally:
        results = finish(procs, 60)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"the first job failed:\n{out}")
    return parse_events(line, "committed")[0], seconds


def run_mode(base: str, mode: str, trials: int, mib: float, rng: random.Random
             ) -> tuple[Tally, float]:
    """Every trial of one mode in a fresh root; returns the tally and one save's time."""
    root = os.path.join(base, mode)
    committed, seconds = time_one_save(root, mode, mib)
    tally = Tally()
    for _ in range(trials):
        committed = trial(root, mode, mib, rng.uniform(0.0, 1.25 * seconds), committed,
                          tally, rng)
    return tally, seconds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30, help="per mode")
    parser.add_argument("--mib", type=float, default=300.0, help="checkpoint size")
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.mib <= 0:
        parser.error("--trials must be >= 1 and --mib > 0")
    rng = random.Random(args.seed)
    modes = MODES if args.mode == "both" else (args.mode,)
    failed = False
    base = tempfile.mkdtemp(prefix="netdist-crash-", dir=args.dir)
    try:
        for mode in modes:
            tally, seconds = run_mode(base, mode, args.trials, args.mib, rng)
            label = "overwrite=True" if mode == "overwrite" else "default (next step)"
            print(f"{label}: {tally.trials} SIGKILLs of both ranks, {args.mib:g} MiB, "
                  f"{WORLD} ranks over TCP, kill 0-{1.25 * seconds:.2f} s into a save")
            print(f"  loadable & byte-exact: {tally.exact}/{tally.trials} (the killed save "
                  f"not committed: {tally.old}, committed: {tally.new}); resumed from the "
                  f"newest and saved forward: {tally.forward}/{tally.trials}")
            for failure in tally.failures:
                print(f"  FAILED: {failure}")
            failed = failed or bool(tally.failures)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
