"""netdist as torch's per-device backend for the CPU: ``"cpu:netdist,cuda:..."`` strings.

Beside another device's backend, netdist is a ``Backend`` (``NetdistBackend``): torch
builds the ``ProcessGroup``, registers netdist on it for the CPU only, and sends CPU
tensors to netdist and CUDA tensors to the backend named for ``cuda``. Alone
(``"netdist"``), netdist stays the whole group (``ProcessGroupNetdist``), as before. This
machine may have no GPU, so the dispatch is checked with ``"cpu:netdist,cuda:gloo"`` (a
string that initialises without one: Gloo builds its CUDA half lazily): which backend
torch registered per device, which one ran each CPU call (netdist's methods are wrapped
to record their calls), and that the numbers (all-reduces, p2p, a DDP run) are bitwise
those of the same job on ``"cpu:gloo,cuda:gloo"``. ``benchmarks/gpu_mixed_backends.py``
runs the NCCL half on a machine with GPUs. On a machine without one,
``"cpu:netdist,cuda:nccl"`` must fail exactly as ``"cpu:gloo,cuda:nccl"`` does, naming
the missing CUDA device, not netdist. Real processes, 2 ranks, TCP on 127.0.0.1, every
wait bounded.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.benchmark_harness import load_benchmark
from tests.torch.torch_ranks import (
    COLLECTIVE_TIMEOUT,
    TEST_TIMEOUT,
    assert_bitwise_equal,
    run_ranks,
    train_steps,
)

WORLD = 2
REPO = Path(__file__).resolve().parents[2]
GPU_SCRIPT = REPO / "benchmarks" / "gpu_mixed_backends.py"
gpu_script = load_benchmark("gpu_mixed_backends")
CPU = torch.device("cpu")
#: netdist's backend methods whose calls a rank records (what ran a CPU call)
RECORDED = ("allreduce", "broadcast", "allgather", "all_gather_single", "barrier",
            "monitored_barrier", "send", "recv")
#: the job's strings, and the Gloo-only strings whose results they must equal bitwise
NETDIST_STRINGS = ["cpu:netdist,cuda:gloo", "cuda:gloo,cpu:netdist", "netdist"]
GLOO_STRINGS = ["cpu:gloo,cuda:gloo", "cuda:gloo,cpu:gloo", "gloo"]
#: on a machine without a GPU each netdist string must fail as the Gloo string beside it
NCCL_STRINGS = [("cpu:netdist,cuda:nccl", "cpu:gloo,cuda:nccl"),
                ("cuda:nccl,cpu:netdist", "cuda:nccl,cpu:gloo")]


def _since(calls: list[str], mark: int) -> list[str]:
    return calls[mark:]


def _one_group(rank: int, world: int, backend: str, init_method: str,
               calls: list[str]) -> dict[str, Any]:
    """Join a group on ``backend``, run CPU calls and a short DDP run; what ran where."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    pg = dist.group.WORLD
    assert pg is not None
    out: dict[str, Any] = {
        "group_type": type(pg).__name__,
        "devices": sorted(d.type for d in pg._device_types),
        "backends": {d.type: type(pg._get_backend(d)).__name__ for d in pg._device_types},
        # the backend torch calls the group's default (a torch-built group only)
        "default": pg._get_backend_name() if type(pg) is dist.ProcessGroup else None,
        "string": dist.get_backend(pg),
    }
    mark = len(calls)
    t = torch.arange(6, dtype=torch.float32) * (rank + 1) + 0.25
    dist.all_reduce(t)
    out["all_reduce"], out["all_reduce ran"] = t, _since(calls, mark)

    mark = len(calls)
    a = torch.full((3,), float(rank) + 0.5, dtype=torch.float64)
    dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True).wait()
    out["async all_reduce"], out["async all_reduce ran"] = a, _since(calls, mark)

    mark = len(calls)
    b = torch.arange(4, dtype=torch.int64) * 7 if rank == 1 else torch.zeros(4, dtype=torch.int64)
    dist.broadcast(b, src=1)
    out["broadcast"], out["broadcast ran"] = b, _since(calls, mark)

    mark = len(calls)
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"], out["all_gather_object ran"] = objects, _since(calls, mark)

    mark = len(calls)
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    out["barriers ran"] = _since(calls, mark)

    # point to point: a receive from any source, and the handles of isend / irecv
    if "netdist" in backend and "," in backend:
        try:  # a mixed group refuses it before any message is taken
            dist.recv(torch.zeros(2))
            out["any-source recv"] = "accepted"
        except ValueError as exc:
            out["any-source recv"] = str(exc)
    else:
        got = torch.zeros(2)
        if rank == 0:
            dist.send(torch.tensor([5.0, 6.0]), dst=1)
        elif rank == 1:
            out["any-source src"] = dist.recv(got)
        out["any-source recv"] = got
    mark = len(calls)
    box = torch.tensor([float(rank)])
    work = dist.isend(box, dst=1) if rank == 0 else dist.irecv(box, src=0)
    assert work is not None
    work.wait()
    out["p2p"] = box
    # what to poll on a mixed group (Gloo's p2p handles have no future)
    out["p2p done"] = work.get_future().done() if "netdist" in backend else None
    out["p2p is_completed"] = work.is_completed()
    out["p2p ran"] = _since(calls, mark)

    # a subgroup inherits the string; netdist's CPU half shares the world's netdist job
    sub = dist.new_group(list(range(world)))
    assert isinstance(sub, dist.ProcessGroup)
    mark = len(calls)
    s = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(s, group=sub)
    out["subgroup"], out["subgroup ran"] = s, _since(calls, mark)
    sub_job = getattr(sub._get_backend(CPU), "job", None)
    world_job = getattr(pg._get_backend(CPU), "job", None)
    out["subgroup shares the job"] = sub_job is not None and sub_job is world_job
    if "netdist" in backend:  # the DDP comm hooks find the job behind the CPU backend
        from netdist.torch.hooks import job_of

        out["hooks find the job"] = job_of(pg) is world_job

    # DDP on a CPU model runs its gradient all-reduces on the CPU backend
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mark = len(calls)
    out["ddp losses"] = train_steps(model, opt, rank, world, steps=3, per_rank_batch=4)
    out["ddp ran"] = sorted(set(_since(calls, mark)))
    out["ddp weights"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return out


def mixed_groups(rank: int, world: int, backend: str, init_method: str, out_dir: str,
                 strings: list[str]) -> list[dict[str, Any]]:
    """One rank: a group on each string in turn (the first meets through the runner's
    TCP store, the rest through a file store each), recording netdist's calls."""
    import netdist.torch  # noqa: F401 - registers the backend

    calls = gpu_script.record_netdist_calls(RECORDED)
    results = []
    for i, string in enumerate(strings):
        method = init_method if i == 0 else f"file://{out_dir}/store-{i}"
        results.append(_one_group(rank, world, string, method, calls))
    return results


@pytest.mark.timeout(TEST_TIMEOUT)
def test_cpu_tensors_go_to_netdist_and_match_gloo(tmp_path: Path) -> None:
    ours = run_ranks(mixed_groups, WORLD, NETDIST_STRINGS[0], tmp_path / "netdist",
                     strings=NETDIST_STRINGS)
    gloo = run_ranks(mixed_groups, WORLD, GLOO_STRINGS[0], tmp_path / "gloo",
                     strings=GLOO_STRINGS)
    for rank in range(WORLD):
        for string, mine, reference in zip(NETDIST_STRINGS, ours[rank], gloo[rank]):
            where = f"rank {rank} {string!r}"
            assert mine["string"] == string, where
            if string == "netdist":  # netdist alone: the whole group, as always
                assert mine["group_type"] == "ProcessGroupNetdist", where
                assert mine["backends"] == {"cpu": "ProcessGroupNetdist"}, where
                assert mine["p2p is_completed"] is True, where
                if rank == 1:
                    assert mine["any-source src"] == 0, where
            else:  # torch built the group: netdist its CPU backend, Gloo its CUDA one
                assert mine["group_type"] == "ProcessGroup", where
                assert mine["backends"] == {"cpu": "NetdistBackend",
                                            "cuda": "ProcessGroupGloo"}, where
                # torch makes the non-CPU backend the group's default (as for
                # "cpu:gloo,cuda:nccl"), yet barrier and the object collectives, which
                # torch runs on CPU tensors, still come to netdist
                assert mine["default"] == "gloo", where
                assert mine["any-source recv"].startswith(
                    "recv: a receive from any source (src=None) is not available when "
                    "netdist is one backend of a mixed group"), where
            assert mine["p2p done"] is True, where
            assert mine["p2p ran"] == ["send" if rank == 0 else "recv"], where
            assert mine["all_reduce ran"] == ["allreduce"], where
            assert mine["async all_reduce ran"] == ["allreduce"], where
            assert mine["broadcast ran"] == ["broadcast"], where
            assert mine["all_gather_object ran"], where
            assert set(mine["all_gather_object ran"]) <= {"allgather", "all_gather_single"}, \
                where
            assert mine["barriers ran"] == ["barrier", "monitored_barrier"], where
            assert mine["subgroup ran"] == ["allreduce"], where
            assert mine["subgroup shares the job"] is True, where
            assert mine["hooks find the job"] is True, where
            assert mine["ddp ran"] == ["allreduce", "broadcast"], where
            assert reference["all_reduce ran"] == [], f"{where}: Gloo run recorded netdist"
            if string == "netdist":
                assert_bitwise_equal(mine["any-source recv"], reference["any-source recv"],
                                     f"{where} any-source recv")
            for key in ("all_reduce", "async all_reduce", "broadcast", "all_gather_object",
                        "p2p", "subgroup", "ddp losses", "ddp weights"):
                assert_bitwise_equal(mine[key], reference[key], f"{where} {key}")


def _attempt(rank: int, world: int, string: str, init_method: str) -> dict[str, Any]:
    try:
        dist.init_process_group(string, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return {"error": type(exc).__name__, "message": str(exc).splitlines()[0]}
    pg = dist.group.WORLD
    assert pg is not None
    backends = {d.type: pg._get_backend(d).name() for d in pg._device_types}
    dist.destroy_process_group()
    return {"error": None, "backends": backends}


def nccl_strings(rank: int, world: int, backend: str, init_method: str, out_dir: str,
                 ) -> dict[str, Any]:
    """One rank: try every string of ``NCCL_STRINGS``; ranks meet after each attempt (a
    file store's keys, a bounded wait) so no rank leaves a rendezvous its peer is in."""
    import netdist.torch  # noqa: F401 - registers the backend

    meet = dist.FileStore(f"{out_dir}/meet", world)
    outcomes: dict[str, Any] = {"cuda devices": torch.cuda.device_count()}
    strings = [s for pair in NCCL_STRINGS for s in pair]
    for i, string in enumerate(strings):
        outcomes[string] = _attempt(rank, world, string, f"file://{out_dir}/store-{i}")
        meet.set(f"{i}/{rank}", "done")
        meet.wait([f"{i}/{r}" for r in range(world)],
                  datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    return outcomes


@pytest.mark.timeout(TEST_TIMEOUT)
def test_cpu_netdist_cuda_nccl_fails_as_gloo_does_without_a_gpu(tmp_path: Path) -> None:
    results = run_ranks(nccl_strings, WORLD, "netdist", tmp_path)
    for rank, outcomes in enumerate(results):
        for ours, gloos in NCCL_STRINGS:
            where = f"rank {rank} {ours!r}"
            mine, reference = outcomes[ours], outcomes[gloos]
            if outcomes["cuda devices"] == 0:
                # the NCCL half fails, naming the missing CUDA device (NCCL built in) or
                # NCCL itself (not built in), exactly as it does beside Gloo
                assert mine["error"] is not None, f"{where} initialised without a GPU"
                assert "netdist" not in mine["message"].lower(), where
                assert "cuda" in mine["message"].lower() or "nccl" in mine["message"].lower(), \
                    where
                assert mine == reference, f"{where}: {mine} != Gloo's {reference}"
            else:
                assert mine["error"] == reference["error"], f"{where}: {mine} != {reference}"
                if mine["error"] is None:  # a GPU: netdist on the CPU, NCCL on CUDA
                    assert mine["backends"]["cpu"] == "netdist", where
                    assert mine["backends"]["cuda"] == reference["backends"]["cuda"], where


@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_gpu_script_runs_where_there_are_gpus_and_says_why_not_elsewhere() -> None:
    """``benchmarks/gpu_mixed_backends.py`` exits 2 naming the missing GPU on a machine
    without one; with GPUs it runs its checks on as many ranks as there are (up to 2)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args = [] if gpus == 0 else ["--world-size", str(min(gpus, WORLD))]
    done = subprocess.run([sys.executable, str(GPU_SCRIPT), *args], capture_output=True,
                          text=True, timeout=TEST_TIMEOUT - 30, cwd=REPO, env=env, check=False)
    if gpus == 0:
        assert done.returncode == 2, done.stdout + done.stderr
        assert "cannot run here: no CUDA device: this check needs an NVIDIA GPU" in done.stderr
        assert done.stdout == ""
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "FAIL" not in done.stdout and "PASS" in done.stdout, done.stdout
