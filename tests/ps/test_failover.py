"""Nothing is a single point of failure: a killed server shard, a killed or stopped worker.

Real ``netdist ps-server`` ranks and ``tests.ps._mp_worker`` processes over TCP on
127.0.0.1. Every kill happens at a point the test waits for (a line a worker prints), and
every check is of exact parameter values:

- a primary server shard SIGKILLed mid-training (``NETDIST_PS_REPLICAS=1``): its backup
  takes over and the workers end exactly where training without the kill ends
  (synchronous: the MLP reference; asynchronous: the order-free model, where a lost or
  doubly applied update would change the result);
- a worker SIGKILLed or SIGSTOPped (``WorkerLoss.CONTINUE``) in the asynchronous,
  bounded-staleness and synchronous modes: the others finish, and the parameters are
  those of training without the lost worker's later steps (synchronous updates then
  average over the workers left; asynchronous ones hold those of its acknowledged
  pushes that applied before the others' last pull).
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import ranks
from tests.ps._model import dyadic_result
from tests.ps._mp_worker import DYADIC_LR, MLP_OPTIMIZER
from tests.ps.test_multiprocess import job_args
from tests.ps.test_sharded import local_reference

pytestmark = pytest.mark.slow

pytest.importorskip("netdist.transport.bootstrap")

REPLICATED = {"NETDIST_PS_REPLICAS": "1"}
FAST_LIVENESS = {"NETDIST_HEARTBEAT_INTERVAL": "0.5", "NETDIST_HEARTBEAT_MISSES": "4"}
"""A stopped worker is declared lost after 2 s of silence (the default window is 10 s)."""
EXPECT_TIMEOUT = 60.0
FINISH_TIMEOUT = 90.0


def digest(params: Iterable[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


def results(outdir: Path, worker_ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    return {r: json.loads((outdir / f"rank{r}.json").read_text()) for r in worker_ranks}


def run_job(outdir: Path, world: int, servers: int, extra: Sequence[str],
            env: dict[str, str], act: Any, survivors: Sequence[int]) -> list[Any]:
    """Start the job, ``act(procs)`` once (it waits for its own event), then wait for the
    ranks in ``survivors`` to finish; every process is killed on the way out."""
    procs = ranks.start_ranks(world, "netdist.cli.ps_server",
                              job_args(outdir, *extra, servers=servers), timeout=20.0,
                              job_prefix="ps-failover", env=env)
    try:
        act(procs)
        outputs = ranks.finish_ranks([procs[r] for r in survivors], timeout=FINISH_TIMEOUT)
    finally:
        for proc in procs:
            proc.kill()
    for rank, done in zip(survivors, outputs):
        assert done.returncode == 0, f"rank {rank}:\n{done.stdout}"
    return outputs


# -- a killed primary server shard -----------------------------------------------------


def test_killed_primary_shard_sync_training_ends_as_without_the_kill(tmp_path: Path) -> None:
    steps, pause = 8, 4

    def act(procs: list[ranks.RankProcess]) -> None:
        # worker rank 2 waits before its step-4 push; worker rank 3's is in flight
        procs[2].expect("PAUSED", EXPECT_TIMEOUT)
        procs[0].proc.send_signal(signal.SIGKILL)  # primary of shard 0, backup of shard 1
        procs[0].proc.wait(10)
        procs[2].send_line("go")

    outputs = run_job(tmp_path, 4, 2, ["--pause-at", str(pause), "--steps", str(steps)],
                      REPLICATED, act, survivors=[1, 2, 3])
    assert "took over shard 0" in outputs[0].stdout, outputs[0].stdout
    expected = digest(local_reference(MLP_OPTIMIZER, 2, steps=steps))
    done = results(tmp_path, [2, 3])
    for rank, result in done.items():
        assert result["digest"] == expected, f"rank {rank}: {result}"
        assert result["versions"] == [steps, steps]
        assert result["failovers"] == [[0, 1]]


def test_killed_primary_shard_async_loses_and_repeats_no_update(tmp_path: Path) -> None:
    steps = 24

    def act(procs: list[ranks.RankProcess]) -> None:
        procs[2].expect("STEP 2 5", EXPECT_TIMEOUT)  # both workers are pushing flat out
        procs[1].proc.send_signal(signal.SIGKILL)  # primary of shard 1, backup of shard 0
        procs[1].proc.wait(10)

    run_job(tmp_path, 4, 2, ["--model", "dyadic", "--max-staleness", "none",
                             "--steps", str(steps)], REPLICATED, act, survivors=[0, 2, 3])
    done = results(tmp_path, [2, 3])
    last = max(done.values(), key=lambda r: r["versions"])
    # every push of both workers applied exactly once, on both shards
    assert last["versions"] == [2 * steps, 2 * steps]
    assert last["digest"] == digest(dyadic_result(
        [(w, t) for w in range(2) for t in range(steps)], workers=2, lr=DYADIC_LR))
    for result in done.values():
        assert result["failovers"] == [[1, 0]]


# -- a killed or stopped worker --------------------------------------------------------


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
@pytest.mark.parametrize("max_staleness", ["none", "1", "0"], ids=["async", "bounded", "sync"])
def test_lost_worker_never_stops_the_others(tmp_path: Path, how: signal.Signals,
                                            max_staleness: str) -> None:
    steps, lost_at, workers = 6, 2, 3
    victim = 1  # worker 0 (rank 1) pauses before its step-2 push, then is killed/stopped

    def act(procs: list[ranks.RankProcess]) -> None:
        procs[victim].expect("PAUSED", EXPECT_TIMEOUT)
        procs[victim].proc.send_signal(how)

    model = "mlp" if max_staleness == "0" else "dyadic"
    outputs = run_job(tmp_path, 1 + workers, 1,
                      ["--pause-at", str(lost_at), "--steps", str(steps), "--model", model,
                       "--max-staleness", max_staleness, "--worker-loss", "continue"],
                      FAST_LIVENESS, act, survivors=[0, 2, 3])
    assert f"went on without worker ranks [{victim}]" in outputs[0].stdout, outputs[0].stdout
    done = results(tmp_path, [2, 3])
    if max_staleness == "0":
        # synchronous: every later update averages the two workers left
        expected = digest(local_reference(
            MLP_OPTIMIZER, workers, steps=steps,
            live=lambda step: range(workers) if step < lost_at else (1, 2)))
        for rank, result in done.items():
            assert result["digest"] == expected, f"rank {rank}: {result}"
            assert result["versions"] == [steps]
        return
    survivors = [(w, t) for w in (1, 2) for t in range(steps)]
    lost = [(0, t) for t in range(lost_at)]  # acknowledged before the kill, in this order
    # The survivor whose last pull was answered last (the newest version) saw every
    # survivor's push: each one's last push applied before its own last pull, so before
    # that one. Of the lost worker's pushes it saw those that had applied by then. Under
    # bounded staleness that is both: the lost worker holds the others back until it is
    # dropped. Asynchronous pushes wait for no one, so a lost worker slowed down (a
    # loaded machine) may push after the others have finished: the newest version then
    # holds only the first ``seen`` of its pushes, and the server's count shows that the
    # rest applied, once. The sums are exact, so a lost or doubled update shows.
    last = max(done.values(), key=lambda r: r["versions"])
    seen = lost_at
    if max_staleness == "none":  # one update per push (bounded staleness may batch them)
        seen = last["versions"][0] - len(survivors)
        assert 0 <= seen <= lost_at, last
        updates = f", {len(survivors) + lost_at} updates,"
        assert updates in outputs[0].stdout, outputs[0].stdout
    assert last["digest"] == digest(dyadic_result(survivors + lost[:seen], workers,
                                                  lr=DYADIC_LR)), last
