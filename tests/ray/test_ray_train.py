"""netdist on Ray Train (issue 31, item 2), on a local Ray cluster of two nodes.

One cluster serves the module (Ray starts slowly): a head node with 2 CPUs and a second
node with 1 CPU at its own loopback address (127.0.0.2, on Linux), so the three training
workers sit two on one node and one on the other, and every run checks what each worker
was told against what Ray says of it: rank, world size, local rank, node, host id, the
coordinator on worker 0's node, one token for all.

- The reference: a small DDP job (``tests.ray.loops``) under ``netdist launch -n 3``,
  undisturbed.
- The same job through ``TorchTrainer`` with ``NetdistConfig``, one checkpoint per step,
  ``FailureConfig(max_failures=1)``, and one worker SIGKILLing itself at step 2 of the
  first attempt: Ray Train restarts the whole group, which resumes from the last
  checkpoint and ends with the reference's weights (float64, to 1e-12: the two runs add
  the gradients in the order their host layouts choose); the survivors got netdist's
  error naming the lost rank at once instead of waiting; and netdist's own API works on
  the process group's connections (``netdist.ray.get_job()``). One fit serves both
  checks, since every Ray Train start costs seconds.
- netdist's own API under ``NetdistJobConfig`` (no torch process group):
  ``netdist.connect()``, an all-reduce and a data-parallel step through
  ``AllReduceAggregator``, exact values.

Every wait is bounded: pytest's timeout per test, netdist's timeouts in the workers
(``timeout_s``, ``NETDIST_TIMEOUT``), ``netdist launch --timeout``. In CI (``CI=true``) a
missing Ray fails; elsewhere the module skips, saying what to install.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.ray import require_ray

torch = pytest.importorskip("torch")

from tests.ray.loops import STEPS  # noqa: E402  (imports torch)

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = 3
SECOND_NODE_IP = "127.0.0.2" if sys.platform == "linux" else None
"""Linux routes all of 127.0.0.0/8 to loopback, so the second node gets an address of its
own; elsewhere both nodes share the machine's."""
FIT_BOUND = 240  # seconds a test and its fixtures (fits, launch) may take: a hang guard
NETDIST_TIMEOUT_S = 60  # bounds every collective in the workers
LIVENESS_WINDOW_S = 10.0  # netdist's default: 2 s heartbeats x 5 misses

pytestmark = [
    pytest.mark.slow,
    # Ray Data's default context warns about its own deprecated defaults when Ray Train
    # builds it (ray/data/context.py); nothing this test or netdist sets
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A two-node local Ray cluster for the module, this process its driver; torn down
    (driver, then nodes) however the tests end."""
    require_ray()
    import ray
    from ray.cluster_utils import Cluster

    short = tempfile.mkdtemp(prefix="ndray")  # Ray's socket paths must stay short
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("NETDIST_")]:
            patch.delenv(name)
        patch.setenv("RAY_TMPDIR", short)  # this cluster's files, not /tmp/ray's
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setenv("OMP_NUM_THREADS", "1")
        # Ray Train's controller polls its workers this often (default 2 s); each
        # report with a checkpoint and each failure waits for a poll
        patch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1")
        # one process fewer per fit: no spot-instance preemption here, no metrics read
        patch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        patch.setenv("RAY_TRAIN_METRICS_ENABLED", "0")
        patch.setenv("NETDIST_TIMEOUT", str(NETDIST_TIMEOUT_S))
        patch.setenv("PYTHONPATH", os.pathsep.join(  # the workers import tests.ray.loops
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            nodes = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False})
            try:
                second = {"node_ip_address": SECOND_NODE_IP} if SECOND_NODE_IP else {}
                nodes.add_node(num_cpus=1, object_store_memory=100 * 2**20, **second)
                ray.init(address=nodes.address)
                yield nodes
            finally:
                ray.shutdown()
                nodes.shutdown()
        finally:
            shutil.rmtree(short, ignore_errors=True)
            for sig, handler in handlers.items():  # ray.init installs its own SIGTERM
                signal.signal(sig, handler)        # handler; the rest of the suite keeps ours


def _run_config(tmp: Path, name: str, **kwargs: Any) -> Any:
    import ray.train

    return ray.train.RunConfig(name=name, storage_path=str(tmp / "ray-results"), **kwargs)


def _fit_ddp(tmp: Path, name: str, loop_config: dict[str, Any], **run: Any) -> Any:
    """The DDP job of ``tests.ray.loops`` through ``TorchTrainer`` on netdist."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from netdist.ray import NetdistConfig
    from tests.ray.loops import ray_ddp_loop

    trainer = TorchTrainer(
        ray_ddp_loop, train_loop_config=loop_config,
        torch_config=NetdistConfig(timeout_s=NETDIST_TIMEOUT_S),
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
        run_config=_run_config(tmp, name, **run))
    return trainer.fit()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The DDP job under ``netdist launch -n 3``, undisturbed: rank 0's final weights."""
    return _launch_weights(tmp_path_factory.mktemp("launch"))


@pytest.fixture(scope="module")
def restarted(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The DDP job through ``TorchTrainer`` with ``NetdistConfig``, with
    ``FailureConfig(max_failures=1)``, one checkpoint per step, and rank 1 SIGKILLing
    itself at step 2 of the first attempt: Ray's ``Result`` and the folder of the kill's
    marker and the survivors' notes."""
    import ray.train

    tmp = tmp_path_factory.mktemp("restarted")
    kill = {"rank": 1, "step": 2, "dir": str(tmp)}
    result = _fit_ddp(tmp, "restarted", {"kill": kill},
                      failure_config=ray.train.FailureConfig(max_failures=1),
                      checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2))
    return result, tmp


def _check_workers(workers: list[dict[str, Any]]) -> None:
    """Every worker was told what Ray says of it, all were told the same job, and
    netdist's host layout is Ray's nodes."""
    assert [w["ray"]["rank"] for w in workers] == list(range(WORKERS))
    rank0_ip = workers[0]["ray"]["node_ip"]
    by_node: dict[str, list[int]] = {}
    for rank, worker in enumerate(workers):
        env, seen = worker["env"], worker["ray"]
        by_node.setdefault(seen["node_ip"], []).append(rank)
        assert env["NETDIST_RANK"] == env["RANK"] == str(rank), env
        assert env["NETDIST_WORLD_SIZE"] == env["WORLD_SIZE"] == str(WORKERS), env
        assert env["LOCAL_RANK"] == str(seen["local_rank"]), (env, seen)
        assert env["LOCAL_WORLD_SIZE"] == str(seen["local_world_size"]), (env, seen)
        assert env["NODE_RANK"] == str(seen["node_rank"]), (env, seen)
        assert env["NETDIST_HOST_ID"] == env["NETDIST_ADVERTISE_ADDR"] == seen["node_ip"]
        host, port = env["NETDIST_COORDINATOR"].rsplit(":", 1)
        assert host == env["MASTER_ADDR"] == rank0_ip, env
        assert port != env["MASTER_PORT"], env
        assert worker["token_length"] == 64
    # one job: the same coordinator, job id and token everywhere
    for key in ("NETDIST_COORDINATOR", "NETDIST_JOB_ID", "MASTER_PORT"):
        assert len({w["env"][key] for w in workers}) == 1, [w["env"][key] for w in workers]
    assert len({w["token_digest"] for w in workers}) == 1
    # Ray's local ranks number each node's workers, and netdist's hosts are Ray's nodes
    for ranks in by_node.values():
        assert sorted(workers[r]["ray"]["local_rank"] for r in ranks) == list(range(len(ranks)))
        assert len({workers[r]["host_key"] for r in ranks}) == 1
    assert len({w["host_key"] for w in workers}) == len(by_node)
    if SECOND_NODE_IP is not None:
        assert sorted(len(r) for r in by_node.values()) == [1, 2], by_node


def _launch_weights(tmp: Path) -> dict[str, Any]:
    """The same DDP job under ``netdist launch -n 3``: rank 0's final weights."""
    out = tmp / "launch.pt"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "TORCHELASTIC_", "RAY_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "netdist", "launch", "-n", str(WORKERS), "--timeout", "90",
         "--", sys.executable, "-m", "tests.ray.loops", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state: dict[str, Any] = torch.load(out, weights_only=True)
    return {name: value.numpy() for name, value in state.items()}


def _assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                         what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12,
                                   err_msg=f"{what}: {name}")


@pytest.mark.timeout(FIT_BOUND)
def test_ddp_through_torch_trainer_equals_netdist_launch(
        restarted: tuple[Any, Path], launched: dict[str, np.ndarray]) -> None:
    result = restarted[0].return_value
    assert result["backend"] == "netdist"
    assert result["all_reduce"] == [6.0]  # netdist's own API through get_job(): 1 + 2 + 3
    _check_workers(result["workers"])
    assert restarted[0].metrics["step"] == STEPS - 1  # one report per step, the last kept
    _assert_same_weights(result["weights"], launched, "Ray Train (restarted) vs netdist launch")


@pytest.mark.timeout(FIT_BOUND)
def test_killed_worker_restarts_the_group_from_the_last_checkpoint(
        restarted: tuple[Any, Path]) -> None:
    result, tmp = restarted
    assert json.loads((tmp / "killed").read_text())["rank"] == 1  # it did die
    assert result.return_value["resumed_from"] == 2  # step 1's checkpoint, the last one
    # the survivors were not left waiting: netdist named the lost rank at once
    notes = [json.loads(p.read_text()) for p in sorted(tmp.glob("error-rank*.json"))]
    assert sorted(n["rank"] for n in notes) == [0, 2], notes
    for note in notes:
        assert note["step"] == 2, note
        assert "rank 1" in note["message"], note
        assert note["after_kill_s"] < LIVENESS_WINDOW_S, note


@pytest.mark.timeout(FIT_BOUND)
def test_netdist_api_under_netdist_job_config(cluster: Any, tmp_path: Path) -> None:
    import ray.train
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from netdist.ray import NetdistJobConfig
    from tests.ray.loops import ray_own_api_loop

    trainer = DataParallelTrainer(
        ray_own_api_loop, train_loop_config={"lr": 0.25}, backend_config=NetdistJobConfig(),
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
        run_config=_run_config(tmp_path, "own-api"))
    result = trainer.fit().return_value
    assert result["world_size"] == WORKERS
    assert result["all_reduce"] == [6.0] * 4                     # 1 + 2 + 3
    assert result["averaged"] == [2.0, 4.0, 6.0]                 # mean of p x (rank + 1)
    assert result["params"] == [[0.5, 1.0, 1.5]] * WORKERS       # p - 0.25 x 2p, everywhere
    _check_workers(result["workers"])
