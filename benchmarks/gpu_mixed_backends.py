"""netdist beside NCCL on a machine with NVIDIA GPUs: ``"cpu:netdist,cuda:nccl"`` (issue 27).

Runs the same job twice, on ``"cpu:netdist,cuda:nccl"`` and on torch's reference mix
``"cpu:gloo,cuda:nccl"``, each time as ``--world-size`` processes on 127.0.0.1, one GPU per
rank (NCCL refuses two ranks on one GPU). Each rank, after ``torch.cuda.set_device(rank)``
and ``init_process_group(backend)``:

- trains a small CUDA model under ``DistributedDataParallel`` for ``--steps`` SGD steps
  (deterministic CUDA algorithms, a fixed seed);
- all-reduces a CUDA tensor and a CPU tensor;
- calls ``dist.barrier()`` (torch runs it on the group's bound GPU if it has one, else
  on the CPU backend) and ``dist.all_gather_object`` (on the CPU backend).

netdist's backend methods are wrapped to record their calls, so every call is reported
as run by netdist (recorded) or by the backend torch registered for its tensors' device.
Then every result (both all-reduces, the DDP losses and weights) is compared bitwise
between the two runs. One line per check, ``PASS`` or ``FAIL``; exit status 0 when all
pass, 1 when one fails, 2 when this machine cannot run the job (no CUDA device, fewer
GPUs than ranks, or torch without NCCL).

    python benchmarks/gpu_mixed_backends.py                   # 2 ranks: needs 2 GPUs
    python benchmarks/gpu_mixed_backends.py --world-size 1    # one GPU: the dispatch only

No timing is measured. Every run is bounded by ``--timeout``; loopback only. Without a
GPU, ``tests/torch/test_mixed_backends.py`` checks the same dispatch with
``"cpu:netdist,cuda:gloo"``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from collections.abc import Sequence
from typing import Any

MIXED = "cpu:netdist,cuda:nccl"
REFERENCE = "cpu:gloo,cuda:nccl"
RECORDED = ("allreduce", "broadcast", "allgather", "all_gather_single", "barrier")
"""netdist's backend methods whose calls a rank records (what ran each call)."""
COMPARED = ("all_reduce cuda", "all_reduce cpu", "ddp losses", "ddp weights")


# -- one rank ---------------------------------------------------------------------------

def record_netdist_calls(names: Sequence[str] = RECORDED) -> list[str]:
    """Wrap netdist's backend methods ``names`` so each call appends its name to the
    returned list (the backend still does the work: this only observes which one ran).
    ``tests/torch/test_mixed_backends.py`` records through this too."""
    from netdist.torch.backend import NetdistOps

    calls: list[str] = []
    for name in names:
        original = getattr(NetdistOps, name)

        def recording(self: Any, *args: Any, _original: Any = original, _name: str = name,
                      **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(NetdistOps, name, recording)
    return calls


def worker(backend: str, steps: int, out_dir: str, collective_timeout: float) -> None:
    """One rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` from the
    environment): run the job on ``backend`` and save what ran where and the results."""
    import torch
    import torch.distributed as dist

    import netdist.torch  # noqa: F401 - registers the backend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    gpu = torch.device("cuda", rank)
    torch.use_deterministic_algorithms(True)
    calls = record_netdist_calls()
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_timeout))
    pg = dist.group.WORLD
    assert pg is not None
    backends = {d.type: pg._get_backend(d).name() for d in pg._device_types}
    ran: dict[str, str] = {}
    devices: dict[str, str] = {}
    results: dict[str, Any] = {}

    def who(label: str, device: str, mark: int) -> None:
        """Record who ran the calls since ``mark``, made on ``device``'s tensors."""
        seen = sorted(set(calls[mark:]))
        devices[label] = device
        ran[label] = (f"netdist ({', '.join(seen)})" if seen else
                      f"{backends.get(device, '?')} (netdist saw nothing)")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(gpu)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1234 + rank)
    losses = []
    mark = len(calls)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data).to(gpu)
        y = torch.randn(16, 8, generator=data).to(gpu)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    who("DDP on a CUDA model (broadcast, gradient all-reduces)", "cuda", mark)
    results["ddp losses"] = torch.stack(losses).cpu()
    results["ddp weights"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}

    mark = len(calls)
    t = torch.arange(4096, dtype=torch.float32, device=gpu) * (rank + 1) + 0.5
    dist.all_reduce(t)
    torch.cuda.synchronize()
    who(f"all_reduce of a CUDA tensor ({gpu})", "cuda", mark)
    results["all_reduce cuda"] = t.cpu()

    mark = len(calls)
    c = torch.arange(4096, dtype=torch.float32) * (rank + 1) + 0.5
    dist.all_reduce(c)
    who("all_reduce of a CPU tensor", "cpu", mark)
    results["all_reduce cpu"] = c

    # dist.barrier runs on the group's bound GPU if it has one (device_id=, or NCCL
    # binding the group when it starts), else on the CPU backend
    bound = pg.bound_device_id
    mark = len(calls)
    dist.barrier()
    who("barrier", bound.type if bound is not None else "cpu", mark)
    mark = len(calls)
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    who("all_gather_object", "cpu", mark)
    results["objects"] = objects

    dist.destroy_process_group()
    report = {"backend": backend, "rank": rank, "device backends": backends, "ran": ran,
              "devices": devices, "gpu": torch.cuda.get_device_name(gpu)}
    label = _label(backend)
    torch.save(results, Path(out_dir) / f"{label}-rank{rank}.pt")
    (Path(out_dir) / f"{label}-rank{rank}.json").write_text(json.dumps(report))


# -- the driver -------------------------------------------------------------------------

def _label(backend: str) -> str:
    return backend.replace(":", "-").replace(",", "_")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(backend: str, args: argparse.Namespace, out_dir: str) -> list[str]:
    """Run ``backend``'s job on ``args.world_size`` processes; return their failures."""
    env = dict(os.environ, WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    procs = []
    for rank in range(args.world_size):
        cmd = [sys.executable, __file__, "--worker", backend, "--steps", str(args.steps),
               "--out", out_dir, "--collective-timeout", str(args.collective_timeout)]
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    failures = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output, _ = proc.communicate()
            failures.append(f"rank {rank} of {backend!r} ran past --timeout {args.timeout}s:"
                            f"\n{output[-3000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"rank {rank} of {backend!r} exited {proc.returncode}:"
                            f"\n{output[-3000:]}")
    return failures


def _bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8),
                                b.contiguous().view(torch.uint8)))
    return bool(a == b)


def _unusable_machine(world_size: int) -> str | None:
    """Why this machine cannot run the job, or None."""
    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return (f"no CUDA device: this check needs an NVIDIA GPU (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); without one, "
                "tests/torch/test_mixed_backends.py checks the dispatch with "
                "'cpu:netdist,cuda:gloo'")
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL built in"
    if count < world_size:
        return (f"NCCL needs one GPU per rank: found {count} for {world_size} ranks; "
                f"run with --world-size {count}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks, one GPU each (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="DDP steps (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each run may take (default 300)")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="init_process_group timeout in seconds (default 120)")
    parser.add_argument("--worker", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.out, args.collective_timeout)
        return 0

    why = _unusable_machine(args.world_size)
    if why is not None:
        print(f"gpu_mixed_backends: cannot run here: {why}", file=sys.stderr)
        return 2

    import torch

    with tempfile.TemporaryDirectory(prefix="gpu_mixed_backends-") as out_dir:
        for backend in (MIXED, REFERENCE):
            failures = run_job(backend, args, out_dir)
            if failures:
                print("\n".join(failures), file=sys.stderr)
                print(f"FAIL  the {backend!r} job did not complete")
                return 1
        reports = {b: [json.loads((Path(out_dir) / f"{_label(b)}-rank{r}.json").read_text())
                       for r in range(args.world_size)] for b in (MIXED, REFERENCE)}
        results = {b: [torch.load(Path(out_dir) / f"{_label(b)}-rank{r}.pt",
                                  weights_only=True) for r in range(args.world_size)]
                   for b in (MIXED, REFERENCE)}

    checks: list[tuple[bool, str]] = []
    for backend in (MIXED, REFERENCE):
        first = reports[backend][0]
        print(f'\n"{backend}": {args.world_size} ranks on {first["gpu"]}; device backends: '
              + ", ".join(f"{d} -> {n}" for d, n in first["device backends"].items()))
        for call, by in first["ran"].items():
            print(f"  {call:<55} {first['devices'][call]:<5} ran on {by}")
        for report in reports[backend]:
            ran, rank = report["ran"], report["rank"]
            cpu_calls = [c for c in ran if report["devices"][c] == "cpu"]
            cuda_calls = [c for c in ran if c not in cpu_calls]
            if backend == MIXED:
                checks.append((all(ran[c].startswith("netdist") for c in cpu_calls),
                               f"rank {rank}: every CPU call ran on netdist"))
                checks.append((not any(ran[c].startswith("netdist") for c in cuda_calls),
                               f"rank {rank}: no CUDA call reached netdist"))
                checks.append((report["device backends"].get("cpu") == "netdist",
                               f"rank {rank}: torch registered netdist for the CPU"))
            else:
                checks.append((not any(v.startswith("netdist") for v in ran.values()),
                               f"rank {rank}: netdist saw none of the reference's calls"))
            checks.append((report["device backends"].get("cuda") ==
                           reports[REFERENCE][rank]["device backends"].get("cuda"),
                           f'rank {rank} "{backend}": CUDA backend is the reference\'s '
                           f'({reports[REFERENCE][rank]["device backends"].get("cuda")})'))
    print(f'\nresults of "{MIXED}" against "{REFERENCE}" (bitwise):')
    for rank in range(args.world_size):
        for key in COMPARED:
            same = _bitwise_equal(results[MIXED][rank][key], results[REFERENCE][rank][key])
            checks.append((same, f"rank {rank}: {key} equal: {same}"))
        checks.append((results[MIXED][rank]["objects"] == [{"rank": r} for r in
                                                          range(args.world_size)],
                       f"rank {rank}: all_gather_object gathered every rank"))
    for ok, what in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
