"""torch's own distributed test suite, a fast subset, passes on netdist as it does on Gloo.

torch ships its distributed tests in the wheel (``distributed_test._DistTestBase``, run by
pytorch's ``test_distributed_spawn.py``). ``benchmarks/torch_conformance.py`` runs them for
a backend; this file runs ~30 of them, chosen to touch every CPU collective the suite
exercises on Gloo at world size 2: all_reduce with each ReduceOp (SUM, MAX, MIN, PRODUCT),
complex tensors and the ops complex refuses, async and coalesced; broadcast (its helper
walks every CPU dtype); all_gather (plain, complex, coalesced); gather and scatter with
their argument checks; reduce; send/recv, any-source recv, tags, isend/irecv; barrier;
batch_isend_irecv; barrier and monitored_barrier; the object collectives; subgroups
(``new_group`` of all ranks, destroyed again); ``Work.get_future``; and DDP (training
parity with a local model, static graph). (torch's suite has no CPU reduce_scatter or
all_to_all test that Gloo runs: those are CUDA- or MPI-only there.)

The subset runs once per module, for both backends, through the runner, with ranks
started by a forkserver (the test bodies are torch's, unchanged; only the ~3 s of imports
each spawned rank would pay is saved). torch's suite decides some skips by the backend's
name (``require_backend_is_available({"gloo"})``, "get_future is only supported on mpi,
nccl and gloo"), so netdist runs with ``--gate-as gloo``: the suite is imported as for
Gloo, then handed netdist, and exactly Gloo's tests run. Each torch test is one pytest
test here: it must pass on Gloo (else the subset is wrong for this torch) and on netdist
(else the backend is). Everything is real processes and TCP on 127.0.0.1; every wait is
bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "benchmarks" / "torch_conformance.py"

SUBSET = (
    # all_reduce: every ReduceOp the suite checks on CPU, complex, async, coalesced
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_min",
    "test_all_reduce_product",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_sum_async",
    "test_all_reduce_coalesced_sum",
    # broadcast (float, int, half, bool... in one helper), all_gather
    "test_broadcast",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    # gather / scatter / reduce
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_reduce_sum",
    # point to point
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    # barriers
    "test_barrier",
    "test_monitored_barrier_gloo",
    # object collectives through torch's helpers
    "test_all_gather_object_default_pg",
    "test_scatter_object_list",
    # subgroups: new_group over all ranks, collectives on it, destroy
    "test_all_reduce_full_group_sum",
    "test_broadcast_full_group",
    "test_barrier_full_group",
    "test_destroy_full_group",
    # async Work.get_future, DistributedDataParallel
    "test_get_future",
    "test_DistributedDataParallelCPU",
    "test_static_graph_api_cpu",
)

RUN_TIMEOUT = 900.0
"""Bound on the whole run (both backends); a loaded 2-core machine needs ~3 min."""

PER_TEST_TIMEOUT = 120
"""torch's join timeout for one suite test (the runner kills a worker 60 s past it)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT + 60)]


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run :data:`SUBSET` for gloo and netdist once; the runner's JSON report."""
    work = tmp_path_factory.mktemp("torch_conformance")
    tests_file = work / "tests.txt"
    tests_file.write_text("\n".join(SUBSET) + "\n", encoding="utf-8")
    report = work / "report.json"
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(RUNNER), "--backend", "both", "--tests-file",
               str(tests_file), "--start-method", "forkserver", "--gate-as", "gloo",
               "--jobs", "2",
               "--batch", str((len(SUBSET) + 1) // 2), "--timeout", str(PER_TEST_TIMEOUT),
               "--json", str(report), "--log-dir", str(work / "logs"), "--quiet"]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the conformance run took over {RUN_TIMEOUT:.0f} s; partial output:\n"
                    f"{exc.stdout!r}")
    assert report.exists(), f"runner wrote no report (status {done.returncode}):\n" \
                            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    result["_stdout"] = done.stdout
    result["_returncode"] = done.returncode
    return result


def test_the_runner_ran_every_subset_test_on_both_backends(suite_results: dict[str, Any]) -> None:
    """Both backends report exactly the subset, counted; the exit status agrees."""
    for backend in ("gloo", "netdist"):
        info = suite_results["backends"][backend]
        assert sorted(info["tests"]) == sorted(SUBSET), backend
        counts = info["counts"]
        assert counts["total"] == len(SUBSET)
        assert sum(counts[k] for k in ("passed", "failed", "error", "skipped")) == len(SUBSET)
    missing = suite_results["gloo_pass_netdist_not"]
    broken = [m for m in missing if m["outcome"] != "skipped"]
    assert suite_results["_returncode"] == (1 if broken else 0), suite_results["_stdout"]


@pytest.mark.parametrize("name", SUBSET)
def test_torch_suite_test_passes_on_gloo_and_netdist(suite_results: dict[str, Any],
                                                     name: str) -> None:
    """The torch suite test ``name`` passes with backend gloo and with backend netdist."""
    gloo = suite_results["backends"]["gloo"]["tests"][name]
    netdist = suite_results["backends"]["netdist"]["tests"][name]
    assert gloo["outcome"] == "passed", (
        f"{name} does not pass on Gloo with this torch ({gloo['outcome']}: "
        f"{gloo['reason']}); the subset needs updating")
    assert netdist["outcome"] == "passed", (
        f"{name} on netdist: {netdist['outcome']}: {netdist['reason']}\n"
        f"{netdist.get('detail', '')[-3000:]}")
