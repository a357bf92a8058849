"""netdist's DDP communication hooks (``netdist.torch.hooks``) in real 2-rank training runs.

Each test spawns two rank processes. Each rank joins a torch process group (Gloo, or the
netdist backend) and a ``netdist.Job`` for the hook, then trains two copies of one small
MLP side by side on the same data: a plain DDP model (the reference: DDP's own
all-reduce on the process group's backend) and a DDP model with a netdist hook. A
recording wrapper around the hook keeps each rank's local gradients as they enter the
hook, so the parent can recompute what the hook must have produced, bit for bit.

The model is ~3.5 KB of gradients with ``bucket_cap_mb=0.001``: DDP's first iteration has
one bucket (torch puts every parameter in one bucket until it rebuilds them) and the
later ones several, so both the rebuild and the ordering of several buckets in flight
are exercised.
"""

from __future__ import annotations

import os
import secrets
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # tests/torch is a package
    from .torch_ranks import assert_bitwise_equal, init_process_group, run_ranks
except ImportError:  # tests/torch itself is on sys.path (rootdir-style import)
    from torch_ranks import assert_bitwise_equal, init_process_group, run_ranks

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 5
BATCH = 16
BUCKET_MB = 0.001
LR = 0.05
SIZES = (8, 32, 16, 4)
"""MLP widths: 884 parameters in six tensors."""
RUN_TIMEOUT = 100.0
"""Hang guard per 2-rank run, below pytest's 120 s: about 10 s on an idle 2-core machine,
30-40 s under heavy load (spawning, importing torch, and DDP's first construction, which
imports torch._dynamo, dominate)."""


def make_model() -> nn.Module:
    """Tanh MLP (no exact-zero gradients, so every comparison is about values)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, SIZES[0], generator=gen), torch.randn(BATCH, SIZES[-1], generator=gen)


def connect_job(rank: int, world: int, out_dir: str, token: str) -> Any:
    """Join a netdist Job; rank 0 binds port 0 and shares it through a torch FileStore."""
    from netdist.config import DistributedConfig
    from netdist.progress import Job

    store = dist.FileStore(str(Path(out_dir) / "netdist-rendezvous"), world)
    store.set_timeout(timedelta(seconds=30))
    config = DistributedConfig(rank=rank, world_size=world, job_id="comm-hooks", token=token,
                               coordinator=("127.0.0.1", 0), listen_host="127.0.0.1",
                               advertise_addr="127.0.0.1", timeout=30.0)
    if rank == 0:
        def ready(where: tuple[str, int]) -> None:
            store.set("coordinator", f"{where[0]}:{where[1]}")
        return Job.connect(config, on_coordinator_ready=ready)
    host, port = store.get("coordinator").decode().rsplit(":", 1)
    return Job.connect(config.replace(coordinator=(host, int(port))))


def make_state(kind: str, job: Any, options: dict[str, Any]) -> Any:
    from netdist.torch import hooks

    classes = {"topk": hooks.TopKHook, "fp16": hooks.Fp16Hook, "bf16": hooks.Bf16Hook,
               "ps": hooks.ParameterServerHook, "stale": hooks.BoundedStalenessHook}
    return classes[kind](job, **options)


def train(rank: int, world: int, backend: str, init_method: str, out_dir: str, *,
          kind: str, options: dict[str, Any], token: str,
          hide_ml_dtypes: bool = False) -> dict[str, Any]:
    """One rank: a plain DDP model and a hooked one, trained on the same batches.

    On Gloo the hook gets a netdist Job of its own; on the netdist backend it shares the
    backend's (``job_of()``), which the process group closes. ``hide_ml_dtypes`` runs
    the rank as if ``ml_dtypes`` were not installed (netdist is not imported yet in a
    fresh rank process).
    """
    if hide_ml_dtypes:
        assert "netdist.types" not in sys.modules
        sys.modules["ml_dtypes"] = None  # type: ignore[assignment] - as if not installed
    from netdist.torch.hooks import comm_hook, job_of
    from netdist.types import BFLOAT16, BFLOAT16_RAW

    init_process_group(rank, world, backend, init_method)
    own_job = backend != "netdist"
    job = connect_job(rank, world, out_dir, token) if own_job else job_of()
    try:
        plain = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        hooked = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        params = list(hooked.module.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        state = make_state(kind, job, options)
        local: dict[int, torch.Tensor] = {}

        def recording_hook(state, bucket):  # type: ignore[no-untyped-def]
            # unannotated: DDP compares annotations with the real classes, and this module's
            # annotations are strings (``from __future__ import annotations``)
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                local[index[id(p)]] = g.detach().clone()
            return comm_hook(state, bucket)

        hooked.register_comm_hook(state, recording_hook)
        optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (plain, hooked)]
        record: dict[str, list[Any]] = {k: [] for k in (
            "local", "hooked", "plain", "residual", "stats", "plain_params", "hooked_params")}
        for step in range(STEPS):
            x, y = batch(step, rank)
            for model, opt in zip((plain, hooked), optimizers):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
            record["local"].append([local[i] for i in range(len(params))])
            record["hooked"].append([p.grad.clone() for p in params])
            record["plain"].append([p.grad.clone() for p in plain.module.parameters()])
            if kind == "topk":
                record["residual"].append([state.residual(p) for p in params])
            s = state.stats
            record["stats"].append([s.steps, s.bytes_sent, s.bytes_received, s.fp32_bytes,
                                    s.netdist_bytes_sent, s.last_step.sent,
                                    s.last_step.received, s.last_step.fp32_bytes,
                                    s.last_step.buckets])
            for opt in optimizers:
                opt.step()
            record["plain_params"].append([p.detach().clone() for p in plain.module.parameters()])
            record["hooked_params"].append([p.detach().clone() for p in params])
        state.close()
        if kind == "stale":
            report = state.report
            record["log"] = [[e.worker, e.worker_version, e.server_version] for e in report.log]
            record["report"] = [report.version, report.num_workers]
        record["raw_bfloat16"] = BFLOAT16 == BFLOAT16_RAW
        return record
    finally:
        if own_job:
            job.close()


def run(kind: str, tmp_path: Path, backend: str = "gloo", *, hide_ml_dtypes: bool = False,
        **options: Any) -> list[dict[str, Any]]:
    return run_ranks(train, WORLD, backend, tmp_path, timeout=RUN_TIMEOUT, kind=kind,
                     options=options, token=secrets.token_hex(16),
                     hide_ml_dtypes=hide_ml_dtypes)


def numels() -> list[int]:
    return [p.numel() for p in make_model().parameters()]


def check_stats(ranks: list[dict[str, Any]], sent: int, received: int) -> None:
    """Per-step payload as computed from sizes, totals the sums, one record per step."""
    fp32 = 4 * sum(numels())
    for r, out in enumerate(ranks):
        rows = out["stats"]
        for step, row in enumerate(rows, 1):
            assert row[0] == step, (r, row)
            assert row[5:8] == [sent, received, fp32], (r, step, row)
            assert row[1:4] == [step * sent, step * received, step * fp32], (r, step, row)
        buckets = [row[8] for row in rows]
        assert buckets[0] == 1 and max(buckets) > 1, buckets  # DDP rebuilt its buckets


def test_topk_ratio_one_is_plain_ddp(tmp_path: Path) -> None:
    """ratio=1.0 sends everything: the very gradients and parameters of plain DDP."""
    ranks = run("topk", tmp_path, ratio=1.0)
    for out in ranks:
        assert_bitwise_equal(out["hooked"], out["plain"], "top-k 1.0 gradients")
        assert_bitwise_equal(out["hooked_params"], out["plain_params"], "top-k 1.0 params")
        for residuals in out["residual"]:
            assert all(not r.any() for r in residuals)
    per_step = sum(numels()) * (4 + 4)  # int32 index + float32 value per element
    check_stats(ranks, per_step, per_step)
    assert ranks[0]["stats"][-1][4] == STEPS * per_step  # netdist's own counter agrees


def test_topk_error_feedback_residual_and_bytes(tmp_path: Path) -> None:
    """ratio=0.1: each rank sends the top 10% of (residual + gradient) per parameter, the
    residual keeps exactly the rest, and everyone applies the rank-ordered sum / 2."""
    ranks = run("topk", tmp_path, ratio=0.1)
    ks = [max(1, -(-n // 10)) for n in numels()]
    previous = [[torch.zeros(n) for n in numels()] for _ in ranks]
    for step in range(STEPS):
        sent_by_rank = []
        for r, out in enumerate(ranks):
            sent_params = []
            for i, k in enumerate(ks):
                acc = previous[r][i] + out["local"][step][i].reshape(-1)
                idx = torch.topk(acc.abs(), k).indices.sort().values
                sent = torch.zeros_like(acc)
                sent[idx] = acc[idx]
                residual = out["residual"][step][i].reshape(-1)
                assert_bitwise_equal(residual, acc - sent, f"rank {r} step {step} residual {i}")
                previous[r][i] = residual
                sent_params.append((idx, acc[idx]))
            sent_by_rank.append(sent_params)
        for i, n in enumerate(numels()):
            total = torch.zeros(n)
            for r in range(WORLD):  # rank order, as every rank adds them
                idx, values = sent_by_rank[r][i]
                total[idx] += values
            expected = (total / WORLD).reshape(ranks[0]["hooked"][step][i].shape)
            for r, out in enumerate(ranks):
                assert_bitwise_equal(out["hooked"][step][i], expected,
                                     f"rank {r} step {step} averaged gradient {i}")
    per_step = sum(ks) * (4 + 4)
    check_stats(ranks, per_step, per_step)
    assert ranks[1]["stats"][-1][4] == STEPS * per_step
    assert_bitwise_equal(ranks[0]["hooked_params"], ranks[1]["hooked_params"], "params")


@pytest.mark.parametrize("kind, dtype, hide_ml_dtypes", [
    ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False),
    ("bf16", torch.bfloat16, True)], ids=["fp16", "bf16", "bf16-without-ml_dtypes"])
def test_cast_hook_is_ddp_on_rounded_gradients(tmp_path: Path, kind: str, dtype: torch.dtype,
                                               hide_ml_dtypes: bool) -> None:
    """Each rank's gradient / 2 rounded to the wire dtype, summed in that dtype, cast back;
    for bfloat16 the same bits with ``ml_dtypes`` and without it (raw bits on the wire)."""
    ranks = run(kind, tmp_path, hide_ml_dtypes=hide_ml_dtypes)
    assert [out["raw_bfloat16"] for out in ranks] == [hide_ml_dtypes] * WORLD
    for step in range(STEPS):
        for i in range(len(numels())):
            halves = [(out["local"][step][i] * (1.0 / WORLD)).to(dtype) for out in ranks]
            expected = (halves[0] + halves[1]).to(torch.float32)
            for r, out in enumerate(ranks):
                assert_bitwise_equal(out["hooked"][step][i], expected,
                                     f"{kind} rank {r} step {step} gradient {i}")
    per_step = 2 * sum(numels())
    check_stats(ranks, per_step, per_step)
    assert ranks[0]["stats"][-1][4] == STEPS * per_step
    assert_bitwise_equal(ranks[0]["hooked_params"], ranks[1]["hooked_params"], "params")


@pytest.mark.parametrize("backend", ["gloo", "netdist"])
def test_parameter_server_hook_is_ddp_average(tmp_path: Path, backend: str) -> None:
    """Rank 0 serves: (own + rank 1) / 2 equals DDP's own average bit for bit, on a model
    whose DDP runs on Gloo (the hook on a job of its own) or on the netdist backend (the
    hook on the backend's job, ``job_of()``)."""
    ranks = run("ps", tmp_path, backend=backend)
    for out in ranks:
        assert_bitwise_equal(out["hooked"], out["plain"], "parameter-server gradients")
        assert_bitwise_equal(out["hooked_params"], out["plain_params"], "parameter-server params")
    payload = 4 * sum(numels())
    check_stats(ranks, payload, payload)  # the server sends (world - 1) x, a worker 1 x
    for out in ranks:
        assert out["stats"][-1][4] >= STEPS * payload  # plus the one-off layout messages


def test_bounded_staleness_hook(tmp_path: Path) -> None:
    """max_staleness=1: both ranks finish; every server applied each rank's every push,
    none more than 1 version stale; bytes are float64 push + pull of every parameter."""
    ranks = run("stale", tmp_path, max_staleness=1)
    for r, out in enumerate(ranks):
        log = out["log"]
        assert len(log) == WORLD * STEPS, (r, log)  # both ranks serve a shard
        assert sorted(w for w, _, _ in log) == sorted(list(range(WORLD)) * STEPS)
        assert max(server - worker for _, worker, server in log) <= 1, log
        version, workers = out["report"]
        assert workers == WORLD
        assert STEPS <= version <= WORLD * STEPS  # an update holds <= 1 push per rank
        for step in range(STEPS):
            for g in out["hooked"][step]:
                assert torch.isfinite(g).all()
    payload = 8 * sum(numels())
    check_stats_stale(ranks, payload)


def check_stats_stale(ranks: list[dict[str, Any]], payload: int) -> None:
    fp32 = 4 * sum(numels())
    for r, out in enumerate(ranks):
        for step, row in enumerate(out["stats"], 1):
            assert row[:4] == [step, step * payload, step * payload, step * fp32], (r, row)
            assert row[5:8] == [payload, payload, fp32], (r, row)
            assert row[4] >= step * payload  # plus request headers


def lose_a_rank(rank: int, world: int, backend: str, init_method: str, out_dir: str, *,
                token: str) -> str:
    """Rank 1 dies without a goodbye after two steps; rank 0's next backward must raise.

    (Two: DDP's second forward rebuilds its buckets, which talks over the process group.)
    """
    from netdist.torch.hooks import Fp16Hook, comm_hook

    init_process_group(rank, world, backend, init_method)
    job = connect_job(rank, world, out_dir, token)
    try:
        model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        state = Fp16Hook(job)
        model.register_comm_hook(state, comm_hook)
        x, y = batch(0, rank)
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
        if rank == 1:
            torch.save("exited", Path(out_dir) / "rank1.pt")
            os._exit(0)  # sockets closed by the kernel, no BYE
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as exc:
            error = str(exc)
        else:
            error = "backward returned normally"
        state.close()
        return error
    finally:
        job.close()


def test_lost_rank_fails_backward_with_netdist_error(tmp_path: Path) -> None:
    """A bucket whose peer is gone fails its future: DDP's backward raises netdist's
    error naming the rank, instead of hanging."""
    error, exited = run_ranks(lose_a_rank, WORLD, "gloo", tmp_path, timeout=RUN_TIMEOUT,
                              token=secrets.token_hex(16))
    assert exited == "exited"
    assert "PeerLostError: all_reduce" in error and "lost group rank 1" in error, error
