"""The ``netdist`` torch.distributed backend against Gloo, op by op, with real processes.

Every op runs on every CPU dtype with integer-valued data (exact in every dtype and every
summation order), once on Gloo and once on netdist in the same test; the results must be
equal wherever Gloo supports the op, and match NumPy's reference where only netdist does
(AVG, complex). Failures raise torch's error types with netdist's message.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.ranks import finish_ranks, free_port, start_processes

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("backend_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 150.0


def run_scenario(scenario: str, backend: str, world: int, out: Path,
              env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """``backend_worker.py`` running ``scenario`` on ``world`` rank processes, waited for
    (bounded); how each ended."""
    port = free_port()
    procs = start_processes([[str(WORKER), scenario, backend, str(r), str(world), str(port),
                              str(out)] for r in range(world)],
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), **(env or {})),
                            merge_stderr=False)
    return finish_ranks(procs, BOUND)


def _load(out: Path, scenario: str, backend: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{scenario}-{backend}-{r}.json").read_text())
            for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_and_dtype_matches_gloo(tmp_path: Path, world: int) -> None:
    for backend in ("gloo", "netdist"):
        results = run_scenario("ops", backend, world, tmp_path)
        assert [r.returncode for r in results] == [0] * world, \
            "\n".join(r.stderr[-3000:] for r in results)
    gloo, ours = _load(tmp_path, "ops", "gloo", world), _load(tmp_path, "ops", "netdist", world)
    for rank in range(world):
        only_ours = set(ours[rank]) - set(gloo[rank])
        assert all(k.endswith(("/int16", "/complex64")) or "/AVG/" in k for k in only_ours), \
            only_ours
        for key in only_ours:
            if key.endswith("/int16") and key.replace("int16", "int32") in gloo[rank]:
                assert ours[rank][key] == gloo[rank][key.replace("int16", "int32")], key
        if rank == 0:
            assert ours[rank]["gather/complex64"] == [[[float(r + 1), 0.0], [2.0, 0.0],
                                                      [float(r % 2), 0.0], [3.0, 0.0]]
                                                     for r in range(world)]
        for key, value in gloo[rank].items():
            if isinstance(value, dict) and "refused" in value:
                assert isinstance(ours[rank][key], list), f"netdist refused {key}"
                continue  # netdist does more than Gloo here
            assert ours[rank][key] == value, f"rank {rank} {key}: netdist {ours[rank][key]} != gloo {value}"
        n = world
        integers = ("int8", "uint8", "int16", "int32", "int64")
        averaged = 0
        for key, value in ours[rank].items():
            if key.startswith("all_reduce/AVG/"):
                expected_sum = [sum(r + 1 for r in range(n)), 2 * n, sum(r % 2 for r in range(n)), 3 * n]
                if key.endswith(integers):  # NCCL's integer average: truncated
                    assert value == [v // n for v in expected_sum], key
                elif key.endswith("complex64"):  # (real, imaginary) pairs
                    assert [im for _, im in value] == [0.0] * 4, key
                    assert [re for re, _ in value] == pytest.approx(
                        [v / n for v in expected_sum], rel=1e-6), key
                else:
                    assert value == pytest.approx([v / n for v in expected_sum], rel=1e-2), key
                averaged += 1
        assert averaged == 10  # float16/32/64, bfloat16, complex64, int8/16/32/64, uint8
        assert ours[rank]["all_reduce/SUM/complex64"] == [[float(x), 0.0] for x in
                                                          (sum(r + 1 for r in range(n)), 2 * n,
                                                           sum(r % 2 for r in range(n)), 3 * n)]
        assert ours[rank]["async"] == [[float(sum(range(n)) + n * i)] * 3 for i in range(4)]
        assert ours[rank]["batch_isend_irecv"] == [float((rank - 1) % n)] * 2
        assert ours[rank]["all_gather_object"] == [{"rank": r, "name": f"r{r}"} for r in range(n)]


@pytest.mark.parametrize("world", [2, 3])
def test_small_blocking_all_reduces_through_the_lane_are_exact(tmp_path: Path,
                                                              world: int) -> None:
    results = run_scenario("small", "netdist", world, tmp_path)
    assert [r.returncode for r in results] == [0] * world, \
        "\n".join(r.stderr[-3000:] for r in results)
    n = world
    for report in _load(tmp_path, "small", "netdist", world):
        assert report["sums"] == [[n * i + n * (n - 1) // 2, 2 * i * n] for i in range(300)]
        assert report["maxima"] == [float((n - 1) * i) for i in range(300)]
        assert report["means"] == [[i + (n + 1) / 2 - 1] * 3 for i in range(300)]
        assert report["started"] > 0  # some calls finished without an event-loop turn
        mismatch = report["mismatch"]
        assert "DistBackendError" in mismatch["mro"], mismatch
        assert "all_reduce" in mismatch["message"] and "group rank" in mismatch["message"]


def test_avg_of_integers_is_gloos_sum_divided_toward_zero(tmp_path: Path) -> None:
    """``dist.all_reduce(int_tensor, op=ReduceOp.AVG)`` on netdist gives NCCL's integer
    average: bit for bit Gloo's SUM followed by torch's truncating division, for int8,
    uint8, int32 and int64 with sums that wrap and negative sums that leave a remainder,
    blocking (small ones through the shared-memory lane), async, large (the host arena), and
    through reduce and reduce_scatter_tensor. AVG of bool raises TypeError at the call,
    saying AVG (the torch user's op), not netdist's MEAN."""
    world = 2
    for backend in ("gloo", "netdist"):
        results = run_scenario("int_avg", backend, world, tmp_path)
        assert [r.returncode for r in results] == [0] * world, \
            "\n".join(r.stderr[-3000:] for r in results)
    gloo = _load(tmp_path, "int_avg", "gloo", world)
    ours = _load(tmp_path, "int_avg", "netdist", world)
    for rank in range(world):
        errors = {k: ours[rank].pop(k) for k in list(ours[rank]) if k.startswith("bool/")}
        assert ours[rank] == gloo[rank], f"rank {rank}: netdist's AVG differs from Gloo's"
        assert len(ours[rank]) == 4 * (6 if rank == 0 else 5)
        for key, value in ours[rank].items():
            if key.startswith("reduce_scatter") and rank > 0:
                continue  # rank 1's shard starts at element 10
            # min + min wraps to 0, max + max to -2 (-1 after the division), -7 / 2 -> -3
            first = {"int8": [0, -1, -3], "int32": [0, -1, -3], "int64": [0, -1, -3],
                     "uint8": [0, 127, 7]}[key.rsplit("/", 1)[1]]
            assert value[:3] == first, key
        assert set(errors) == {"bool/all_reduce", "bool/all_reduce_async", "bool/reduce"}
        for what, error in errors.items():
            assert error["raised"] == "TypeError", (what, error)
            assert "AVG needs a floating or integer dtype, got bool" in error["message"], error
            assert "MEAN" not in error["message"], error
        assert errors["bool/all_reduce"]["message"].startswith("allreduce AVG"), errors
        assert errors["bool/reduce"]["message"].startswith("reduce AVG"), errors


def test_a_lost_peer_is_a_dist_network_error_naming_it(tmp_path: Path) -> None:
    results = run_scenario("peer_dies", "netdist", 2, tmp_path)
    assert results[1].returncode == 3
    report = json.loads((tmp_path / "peer_dies-netdist-0.json").read_text())
    assert report["type"] == "NetdistNetworkError", report
    assert "DistNetworkError" in report["mro"] and "DistError" in report["mro"]
    assert "rank 1" in report["message"] and "all_reduce" in report["message"], report


def test_the_process_group_timeout_bounds_a_collective(tmp_path: Path) -> None:
    results = run_scenario("peer_stalls", "netdist", 2, tmp_path, env={"TEST_PG_TIMEOUT": "3"})
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    report = _load(tmp_path, "peer_stalls", "netdist", 2)[0]
    assert report["type"] == "NetdistTimeout", report
    assert "DistBackendError" in report["mro"] and "TimeoutError" in report["mro"]
    assert "timed out" in report["message"] and "rank 1" in report["message"], report


def test_ddp_backward_raises_netdists_error_when_a_peer_dies(tmp_path: Path) -> None:
    """DDP's C++ reducer reads the backend's futures: a failed all-reduce must reach
    backward() as an error carrying netdist's message, not as an unreadable value."""
    results = run_scenario("ddp_peer_dies", "netdist", 2, tmp_path)
    assert results[1].returncode == 3
    report = json.loads((tmp_path / "ddp_peer_dies-netdist-0.json").read_text())
    assert report["step"] == 2, report
    assert "rank 1" in report["message"] and "all_reduce" in report["message"], report
    assert "Unable to cast" not in report["message"], report


@pytest.mark.parametrize("hide_ml_dtypes", [False, True])
def test_bfloat16_reductions_match_torch_with_or_without_ml_dtypes(
        tmp_path: Path, hide_ml_dtypes: bool) -> None:
    env = {"HIDE_ML_DTYPES": "1"} if hide_ml_dtypes else {}
    results = run_scenario("bf16", "netdist", 2, tmp_path, env=env)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    for report in _load(tmp_path, "bf16", "netdist", 2):
        assert report == {"ml_dtypes": not hide_ml_dtypes, "SUM": True, "MAX": True}


# -- a failure prints the one real error ------------------------------------------------

FAILING_RUN = '''
import os, sys
import torch
import torch.distributed as dist
import netdist.torch  # registers the backend

rank, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("netdist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 1:
    os._exit(3)  # dies without a goodbye
if scenario == "wait":
    dist.all_reduce(torch.ones(1000), async_op=True).wait()
elif scenario == "unwaited":  # three operations never waited for, then a barrier
    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(3)]
    dist.barrier()
else:
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(10), 1),
                                        dist.P2POp(dist.irecv, torch.ones(10), 1)]):
        work.wait()
'''


@pytest.mark.parametrize("scenario", ["wait", "unwaited", "p2p"])
def test_a_failure_prints_the_one_real_error_and_no_asyncio_noise(scenario: str) -> None:
    """Rank 1 dies; rank 0's error escapes to the interpreter, which exits normally
    (garbage-collecting every future): its stderr holds netdist's error once and no
    "Future/Task exception was never retrieved" from asyncio."""
    port = str(free_port())
    procs = start_processes([["-c", FAILING_RUN, str(r), port, scenario] for r in range(2)],
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                            merge_stderr=False)
    outcomes = finish_ranks(procs, BOUND)
    assert [p.returncode for p in outcomes] == [1, 3], [p.stderr[-3000:] for p in outcomes]
    stderr = outcomes[0].stderr
    assert "never retrieved" not in stderr, stderr
    final = [line for line in stderr.splitlines()
             if "netdist.torch.error_types.NetdistNetworkError: " in line]
    assert len(final) == 1, stderr
    assert "lost group rank 1 (transport rank 1)" in final[0], stderr
