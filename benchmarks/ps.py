"""Parameter-server rounds over real TCP, against Gloo's gather + average + broadcast.

Every rank is a separate process on 127.0.0.1 started by ``netdist.launcher.launch``;
``--mib`` MiB of float32 gradients (``--tensors`` equal tensors) per worker:

- ``gloo``: torch.distributed (Gloo backend, when torch is importable) -- rank 0
  ``gather``s every rank's flat gradient, averages, ``broadcast``s the result;
- ``sync PS``: ``netdist.ps.ParameterServer`` -- rank 0 serves the other ranks and
  contributes its own gradient (the seeds' mode), ``reduce_gradients``;
- ``sharded S``: ``--workers`` worker processes plus S dedicated ``PSServer`` processes
  (S = 1 and 2), ``PSClient.step`` = push gradients + SGD on the servers + pull.

A round starts after a barrier (among the workers for the sharded runs; servers do not
take part in barriers) and its time is the slowest participating rank's. Each method
runs ``--repeats`` times, interleaved with the others so a change in machine load hits
them alike; reported are the median of the per-run medians (``--rounds`` rounds each,
after ``--warmup``) and the best round overall, plus CPU time (user + system) per round
of the busiest rank and of all ranks together: on a shared machine wall time follows the
load, CPU time much less.

    python benchmarks/ps.py                        # 16 MiB, 4 procs, 3 x 20 rounds
    python benchmarks/ps.py --only sharded1,sharded2 --repeats 5 --json ps.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _grads(args: argparse.Namespace, rank: int) -> list[Any]:
    import numpy as np

    total = int(args.mib * 2**20) // 4
    per = total // args.tensors
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(per, dtype=np.float32) for _ in range(args.tensors)]


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3}


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system


def _write_cpu(args: argparse.Namespace, name: str, rank: int, seconds: float) -> None:
    """This rank's CPU time (user + system) per round, load-independent unlike wall time."""
    per_round = seconds / (args.warmup + args.rounds)
    with open(os.path.join(args.outdir, f"cpu_{name}_{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"cpu_ms": per_round * 1e3}, f)


def _write(args: argparse.Namespace, name: str, times: list[float], **extra: Any) -> None:
    with open(os.path.join(args.outdir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump({**_summary(times), "rounds": len(times), **extra}, f)


# -- ranks ------------------------------------------------------------------------------


def _gloo_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["NETDIST_RANK"])
    world = int(os.environ["NETDIST_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}",
                            rank=rank, world_size=world)
    flat = torch.from_numpy(__import__("numpy").concatenate(_grads(args, rank)))
    gathered = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    result = torch.empty_like(flat)
    times = []
    cpu = _cpu_now()
    for i in range(args.warmup + args.rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.gather(flat, gathered, dst=0)
        if rank == 0:
            assert gathered is not None
            result.copy_(gathered[0])
            for g in gathered[1:]:
                result.add_(g)
            result.div_(world)
        dist.broadcast(result, src=0)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(elapsed[0]))
    _write_cpu(args, "gloo", rank, _cpu_now() - cpu)
    if rank == 0:
        _write(args, "gloo", times)
    dist.destroy_process_group()


async def _sync_rank(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.collectives import Group
    from netdist.ps import ParameterServer
    from netdist.transport.bootstrap import init
    from netdist.types import ReduceOp

    async with init() as transport:
        group = Group(transport, timeout=args.op_timeout)
        ps = ParameterServer(group, chunk_bytes=int(args.chunk_mib * 2**20))
        grads = _grads(args, group.rank)
        times = []
        out: list[np.ndarray] = []
        cpu = _cpu_now()
        for i in range(args.warmup + args.rounds):
            await group.barrier()
            start = time.perf_counter()
            out = await ps.reduce_gradients(grads)
            local = np.array([time.perf_counter() - start])
            await group.all_reduce(local, op=ReduceOp.MAX)
            if i >= args.warmup:
                times.append(float(local[0]))
        _write_cpu(args, "sync", group.rank, _cpu_now() - cpu)
        expected = np.mean([_grads(args, r)[0] for r in range(group.world_size)], axis=0)
        correct = bool(np.allclose(out[0], expected, rtol=1e-5, atol=1e-6))
        if group.rank == 0:
            _write(args, "sync", times, correct=correct)


async def _sharded_rank(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.collectives import Group
    from netdist.ps import PSClient, PSServer, SGDConfig
    from netdist.transport.bootstrap import init
    from netdist.types import ReduceOp

    servers = args.servers
    async with init() as transport:
        group = Group(transport, timeout=args.op_timeout)
        workers = group.new_group(list(range(servers, group.world_size)))
        name = f"sharded{servers}"
        if group.rank < servers:
            cpu = _cpu_now()  # includes init: a handful of milliseconds
            await PSServer(group, num_servers=servers, timeout=args.op_timeout).run()
            _write_cpu(args, name, group.rank, _cpu_now() - cpu)
            return
        async with PSClient(group, num_servers=servers, timeout=args.op_timeout) as client:
            grads = _grads(args, group.rank)
            await client.init([np.zeros_like(g) for g in grads],
                              optimizer=SGDConfig(lr=1e-3))
            out = [np.empty_like(g) for g in grads]
            times = []
            cpu = _cpu_now()
            for i in range(args.warmup + args.rounds):
                await workers.barrier()
                start = time.perf_counter()
                await client.step(grads, out=out)
                local = np.array([time.perf_counter() - start])
                await workers.all_reduce(local, op=ReduceOp.MAX)
                if i >= args.warmup:
                    times.append(float(local[0]))
            _write_cpu(args, name, group.rank, _cpu_now() - cpu)
            if workers.rank == 0:
                _write(args, name, times)


# -- driver -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_child(args: argparse.Namespace, role: str, nprocs: int, **extra: Any) -> int:
    from netdist.launcher import launch

    cmd = [sys.executable, HERE, "--role", role, "--outdir", args.outdir,
           "--mib", repr(args.mib), "--tensors", str(args.tensors),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--chunk-mib", repr(args.chunk_mib), "--op-timeout", repr(args.op_timeout)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return launch(cmd, nprocs, prefix_output=True, timeout=args.timeout)


def _load(outdir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(outdir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=16.0, help="gradient MiB per worker")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--nprocs", type=int, default=4, help="ranks of the sync/Gloo runs")
    parser.add_argument("--workers", type=int, default=3, help="workers of the sharded runs")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3,
                        help="run every method this many times, interleaved; report the "
                             "median of the per-run medians and the overall best")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--op-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound per child job")
    parser.add_argument("--only", default="gloo,sync,sharded1,sharded2",
                        help="comma-separated runs (default: all four)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--outdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--servers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role is not None:
        if args.role == "gloo":
            _gloo_rank(args)
            return 0
        from netdist.cli.loop import run

        run(_sync_rank(args) if args.role == "sync" else _sharded_rank(args))
        return 0

    only = [name for name in ("gloo", "sync", "sharded1", "sharded2")
            if name in set(args.only.split(","))]
    if "gloo" in only:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            print("torch is not importable: skipping the Gloo baseline")
            only.remove("gloo")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in only}
    status = 0
    for _ in range(args.repeats):  # interleaved, so load changes hit every method alike
        for name in only:
            with tempfile.TemporaryDirectory() as outdir:
                args.outdir = outdir
                if name == "gloo":
                    status |= _run_child(args, "gloo", args.nprocs, gloo_port=_free_port())
                elif name == "sync":
                    status |= _run_child(args, "sync", args.nprocs)
                else:
                    servers = int(name[-1])
                    status |= _run_child(args, "sharded", servers + args.workers,
                                         servers=servers)
                result = _load(outdir, name)
                cpus = [json.load(open(os.path.join(outdir, f), encoding="utf-8"))["cpu_ms"]
                        for f in sorted(os.listdir(outdir)) if f.startswith(f"cpu_{name}_")]
            if result is not None:
                result["cpu_max_ms"] = max(cpus, default=float("nan"))
                result["cpu_sum_ms"] = sum(cpus)
                runs[name].append(result)
    results: dict[str, dict[str, Any] | None] = {}
    for name in ("gloo", "sync", "sharded1", "sharded2"):
        got = runs.get(name) or []
        results[name] = None if not got else {
            "median_ms": statistics.median(r["median_ms"] for r in got),
            "best_ms": min(r["best_ms"] for r in got),
            "correct": all(r.get("correct", True) for r in got),
            "cpu_max_ms": statistics.median(r["cpu_max_ms"] for r in got),
            "cpu_sum_ms": statistics.median(r["cpu_sum_ms"] for r in got),
            "per_repeat_median_ms": [round(r["median_ms"], 2) for r in got]}

    print(f"\n{args.mib:g} MiB of float32 gradients per worker in {args.tensors} tensors, "
          f"{args.repeats} x {args.rounds} rounds after {args.warmup} warm-up "
          "(ms, slowest rank; median of per-run medians, best):")
    labels = {"gloo": f"Gloo gather+avg+bcast, {args.nprocs} procs",
              "sync": f"sync PS, rank 0 serves {args.nprocs - 1} workers",
              "sharded1": f"1 dedicated server, {args.workers} workers",
              "sharded2": f"2 dedicated servers, {args.workers} workers"}
    for name, label in labels.items():
        r = results[name]
        if r is None:
            print(f"  {label:<42} (not run)")
        else:
            note = "" if r.get("correct", True) else "  RESULT WRONG"
            runs_text = ", ".join(f"{m:.0f}" for m in r["per_repeat_median_ms"])
            print(f"  {label:<42} median {r['median_ms']:7.1f}  best {r['best_ms']:7.1f}"
                  f"  cpu/round busiest {r['cpu_max_ms']:5.1f} all {r['cpu_sum_ms']:6.1f}"
                  f"  (runs: {runs_text}){note}")
    if results["gloo"] and results["sync"]:
        print(f"  sync PS / Gloo (median): {results['sync']['median_ms'] / results['gloo']['median_ms']:.2f}x")
    if results["sharded1"] and results["sharded2"]:
        print(f"  2 servers / 1 server (median): "
              f"{results['sharded2']['median_ms'] / results['sharded1']['median_ms']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
