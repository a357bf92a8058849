"""FSDP: step time per sharding strategy, bytes held per rank, and how much prefetch hides.

n rank processes (``netdist.launcher.launch``, real TCP on 127.0.0.1, one BLAS thread
each) train a float32 MLP of ``units`` x ``Linear(width, width) + ReLU`` -- with the
defaults 8 x 6.25 M = 50.0 M parameters, one FSDP unit per Linear -- with SGD + momentum,
under each strategy in turn. Per strategy the table shows:

``step ms``      median over the measured steps of the slowest rank's step time
                 (zero_grad + forward + loss + backward + optimizer step);
``fwd/bwd/opt``  its parts (median, slowest rank);
``ag wait``      time the training loop sat blocked on parameter all-gathers (the
                 exposed part; median of the per-step mean over ranks);
``peak MB``      the most bytes FSDP held at once on a rank (``memory_stats().peak_total``:
                 params + grads + optimizer state + gathered params + gradient buffers),
                 next to ``memory_estimate().peak`` (an upper bound) and the
                 persistent part (params + grads + optimizer state between steps).

Prefetch. FULL_SHARD runs with ``prefetch_depth=0`` (every all-gather waited for right
away) and ``1`` (the next unit's all-gather in flight while this unit computes), in the
same job. The fraction of all-gather time hidden is::

    hidden = (step_time[prefetch 0] - step_time[prefetch 1]) / ag_wait[prefetch 0]

i.e. how much of the all-gather time that was fully exposed without prefetch disappeared
from the step; ``1 - ag_wait[1] / ag_wait[0]`` (the drop in blocked time) is printed too.
With 4 ranks on a 2-core machine, computation and communication share the cores, so
"hidden" also measures how well the OS interleaves them.

Run::

    python3 benchmarks/fsdp.py                       # 4 ranks, 50 M params, all strategies
    python3 benchmarks/fsdp.py --repeats 3           # three jobs, medians of the three
    python3 benchmarks/fsdp.py --width 1024 --rows 64 --steps 2  # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netdist.collectives import Group  # noqa: E402
from netdist.parallel.fsdp import FSDP, ShardingStrategy  # noqa: E402
from netdist.parallel.sharded_optim import ShardedSGD  # noqa: E402

CONFIGS: list[tuple[str, str, int]] = [
    # (label, strategy, prefetch_depth)
    ("FULL_SHARD", "FULL_SHARD", 0),
    ("FULL_SHARD", "FULL_SHARD", 1),
    ("SHARD_GRAD_OP", "SHARD_GRAD_OP", 1),
    ("NO_SHARD", "NO_SHARD", 1),
    ("HYBRID_SHARD", "HYBRID_SHARD", 1),
]
TIMEOUT = 600.0


class SleepLinear:
    """A ``Linear(width, width)``-sized unit whose compute is a device model.

    It owns real float32 parameters (so FSDP gathers, reduces and updates the same bytes
    as the numpy model) but its forward/backward block the compute thread for a fixed
    time without using a core, like an accelerator kernel the host waits on. It checks
    that its weight is gathered, returns ``x`` unchanged and leaves a zero gradient.
    """

    def __init__(self, width: int, forward_s: float, backward_s: float,
                 rng: np.random.Generator) -> None:
        from netdist.train.nn import Parameter

        bound = 1.0 / np.sqrt(width)
        self.weight = Parameter("weight", rng.uniform(-bound, bound, (width, width))
                                .astype(np.float32))
        self.bias = Parameter("bias", np.zeros(width, np.float32))
        self.forward_s, self.backward_s = forward_s, backward_s

    def parameters(self) -> list[Any]:
        return [self.weight, self.bias]

    def named_parameters(self) -> list[tuple[str, Any]]:
        return [("weight", self.weight), ("bias", self.bias)]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, None]:
        if self.weight.data.shape != (x.shape[1], x.shape[1]):
            raise RuntimeError("weight not gathered")
        time.sleep(self.forward_s)
        return x, None

    def backward(self, ctx: None, grad: np.ndarray) -> np.ndarray:
        if self.weight.data.shape != (grad.shape[1], grad.shape[1]):
            raise RuntimeError("weight not gathered")
        time.sleep(self.backward_s)
        return grad


def build_model(units: int, width: int, compute: str = "numpy", forward_ms: float = 0.0,
                backward_ms: float = 0.0, seed: int = 0) -> Any:
    from netdist.train.nn import Linear, ReLU, Sequential

    rng = np.random.default_rng(seed)
    layers: list[Any] = []
    for _ in range(units):
        if compute == "sleep":
            layers.append(SleepLinear(width, forward_ms / 1e3, backward_ms / 1e3, rng))
        else:
            layers += [Linear(width, width, rng=rng, dtype=np.float32), ReLU()]
    if compute == "sleep":
        holder = type("SleepModel", (), {})()
        holder.layers = layers
        return holder
    return Sequential(*layers)


async def allgather_alone(group: Group, numel: int, reps: int) -> float:
    """Median seconds of one unit-sized all-gather with nothing else running."""
    shard = np.ones(numel // group.world_size, np.float32)
    out = np.empty(shard.size * group.world_size, np.float32)
    times = []
    for _ in range(reps):
        await group.barrier(timeout=TIMEOUT)
        started = time.perf_counter()
        await group.all_gather(shard, out=out, timeout=TIMEOUT)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def worker(spec: dict[str, Any], out_dir: str) -> None:
    try:
        from netdist import init  # type: ignore[attr-defined]
    except ImportError:  # before the top-level export lands
        from netdist.transport.bootstrap import init

    async with init() as transport:
        group = Group(transport, timeout=TIMEOUT)
        rank, world = group.rank, group.world_size
        width, units, rows = spec["width"], spec["units"], spec["rows"]
        rng = np.random.default_rng(100 + rank)
        x = rng.standard_normal((rows, width)).astype(np.float32)
        target = rng.standard_normal((rows, width)).astype(np.float32)
        unit_numel = width * width + width
        results: dict[str, Any] = {
            "allgather_alone": await allgather_alone(group, unit_numel + (-unit_numel) % world,
                                                     spec["ag_reps"]),
            "configs": [],
        }
        for label, strategy, depth in CONFIGS:
            if label not in spec["strategies"]:
                continue
            kwargs: dict[str, Any] = {}
            if strategy == "HYBRID_SHARD":
                if world % spec["intra"] or spec["intra"] == world:
                    continue
                kwargs["intra_node_size"] = spec["intra"]
            model = build_model(units, width, spec["compute"], spec["forward_ms"],
                                spec["backward_ms"])
            fsdp = FSDP(model, group, ShardingStrategy.parse(strategy),
                        optimizer=ShardedSGD(0.01, momentum=0.9), prefetch_depth=depth,
                        check_module_states=False, timeout=TIMEOUT, **kwargs)
            del model
            steps = []
            for step in range(spec["warmup"] + spec["steps"]):
                await group.barrier(timeout=TIMEOUT)
                fsdp.reset_timings()
                started = time.perf_counter()
                fsdp.zero_grad()
                out = await fsdp.forward(x)
                grad = (out - target) * np.float32(2.0 / out.size)
                await fsdp.backward(grad)
                await fsdp.step()
                wall = time.perf_counter() - started
                t = fsdp.timings()
                if step >= spec["warmup"]:
                    steps.append({"wall": wall, "forward": t.forward, "backward": t.backward,
                                  "step": t.step, "compute": t.compute,
                                  "ag_wait": t.allgather_wait, "reduce_wait": t.reduce_wait,
                                  "allgathers": t.allgathers})
            stats, estimate = fsdp.memory_stats(), fsdp.memory_estimate()
            results["configs"].append({
                "label": label, "depth": depth, "steps": steps,
                "peak": stats.peak_total, "persistent": stats.persistent,
                "peak_gathered": stats.peak_gathered, "estimate_peak": estimate.peak,
                "params": sum(lay.numel for lay in fsdp.unit_layouts),
            })
            await fsdp.aclose()
            del fsdp
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(results))
        await group.barrier(timeout=TIMEOUT)


def summarize(per_rank: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float]]:
    """Per config: medians over steps of the slowest rank (times) / mean over ranks (waits)."""
    out = {}
    for index, first in enumerate(per_rank[0]["configs"]):
        runs = [r["configs"][index] for r in per_rank]
        count = len(first["steps"])

        def slowest(key: str) -> float:
            return statistics.median(max(run["steps"][i][key] for run in runs)
                                     for i in range(count))

        def mean(key: str) -> float:
            return statistics.median(statistics.mean(run["steps"][i][key] for run in runs)
                                     for i in range(count))

        out[first["label"], first["depth"]] = {
            "wall": slowest("wall"), "forward": slowest("forward"),
            "backward": slowest("backward"), "step": slowest("step"),
            "compute": mean("compute"), "ag_wait": mean("ag_wait"),
            "reduce_wait": mean("reduce_wait"), "allgathers": first["steps"][0]["allgathers"],
            "peak": max(run["peak"] for run in runs),
            "persistent": max(run["persistent"] for run in runs),
            "estimate_peak": max(run["estimate_peak"] for run in runs),
            "params": first["params"],
        }
    return out


def run_job(args: argparse.Namespace) -> tuple[dict[tuple[str, int], dict[str, float]], float]:
    from netdist.launcher import launch

    spec = {"width": args.width, "units": args.units, "rows": args.rows, "steps": args.steps,
            "warmup": args.warmup, "strategies": args.strategies, "intra": args.intra,
            "ag_reps": 3, "compute": args.compute, "forward_ms": args.forward_ms,
            "backward_ms": args.backward_ms}
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out_dir:
        code = launch([sys.executable, __file__, "_worker", json.dumps(spec), out_dir],
                      nprocs=args.nprocs, env=env, timeout=3600)
        if code != 0:
            raise SystemExit(f"workers failed with exit code {code}")
        per_rank = [json.loads(Path(out_dir, f"rank_{r}.json").read_text())
                    for r in range(args.nprocs)]
    return summarize(per_rank), statistics.median(r["allgather_alone"] for r in per_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--rows", type=int, default=256, help="batch rows per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="jobs to run (medians)")
    parser.add_argument("--intra", type=int, default=2, help="HYBRID_SHARD intra_node_size")
    parser.add_argument("--compute", choices=("numpy", "sleep"), default="numpy",
                        help="numpy: real float32 matmuls (one BLAS thread per rank); "
                             "sleep: a device model, see SleepLinear")
    parser.add_argument("--forward-ms", type=float, default=150.0,
                        help="--compute sleep: forward time per unit")
    parser.add_argument("--backward-ms", type=float, default=300.0,
                        help="--compute sleep: backward time per unit")
    parser.add_argument("--strategies", default=",".join(dict.fromkeys(c[0] for c in CONFIGS)))
    args = parser.parse_args()
    args.strategies = [s.strip().upper() for s in args.strategies.split(",") if s.strip()]

    jobs = []
    alone = []
    for _ in range(args.repeats):
        summary, ag = run_job(args)
        jobs.append(summary)
        alone.append(ag)
    keys = list(jobs[0])
    med = {key: {field: statistics.median(job[key][field] for job in jobs)
                 for field in jobs[0][key]} for key in keys}
    params = next(iter(med.values()))["params"] if med else 0
    mb = 1024 * 1024
    print(f"fsdp: {args.nprocs} ranks over TCP on 127.0.0.1, {os.cpu_count()} cores, "
          f"{args.units} units x Linear({args.width}, {args.width}) float32 = "
          f"{params / 1e6:.1f} M params, {args.rows} rows/rank, SGD momentum, compute="
          + (args.compute if args.compute == "numpy" else
             f"sleep ({args.forward_ms:.0f} ms fwd, {args.backward_ms:.0f} ms bwd per unit)")
          + ", "
          f"{args.steps} steps after {args.warmup} warm-up, median of {args.repeats} job(s)")
    print(f"one unit all-gather alone ({(args.width * args.width + args.width) * 4 / mb:.1f}"
          f" MB): {statistics.median(alone) * 1e3:.1f} ms")
    print(f"{'strategy':14} {'pf':>2} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'opt':>7} "
          f"{'compute':>8} {'ag wait':>8} {'rs wait':>8} {'peak MB':>8} {'est MB':>8} "
          f"{'persist':>8}")
    for (label, depth), row in med.items():
        print(f"{label:14} {depth:>2} {row['wall'] * 1e3:8.0f} {row['forward'] * 1e3:7.0f} "
              f"{row['backward'] * 1e3:7.0f} {row['step'] * 1e3:7.0f} "
              f"{row['compute'] * 1e3:8.0f} {row['ag_wait'] * 1e3:8.0f} "
              f"{row['reduce_wait'] * 1e3:8.0f} {row['peak'] / mb:8.1f} "
              f"{row['estimate_peak'] / mb:8.1f} {row['persistent'] / mb:8.1f}")
    if ("FULL_SHARD", 0) in med and ("FULL_SHARD", 1) in med:
        off, on = med["FULL_SHARD", 0], med["FULL_SHARD", 1]
        hidden = (off["wall"] - on["wall"]) / off["ag_wait"] if off["ag_wait"] > 0 else 0.0
        drop = 1 - on["ag_wait"] / off["ag_wait"] if off["ag_wait"] > 0 else 0.0
        per_job = [((j["FULL_SHARD", 0]["wall"] - j["FULL_SHARD", 1]["wall"])
                    / j["FULL_SHARD", 0]["ag_wait"]) for j in jobs]
        print(f"prefetch (FULL_SHARD, {off['allgathers']:.0f} all-gathers/step): "
              f"hidden = (step[pf0] - step[pf1]) / ag_wait[pf0] = "
              f"({off['wall'] * 1e3:.0f} - {on['wall'] * 1e3:.0f}) / "
              f"{off['ag_wait'] * 1e3:.0f} ms = {hidden:.0%}"
              f" (per job: {', '.join(f'{h:.0%}' for h in per_job)}); "
              f"blocked all-gather time dropped by {drop:.0%}")
        exposed = off["ag_wait"] + off["reduce_wait"]
        if exposed > 0:
            print(f"  (prefetch_depth=0 also waits for each gradient reduce-scatter at once; "
                  f"share of all exposed communication hidden = (step[pf0] - step[pf1]) / "
                  f"(ag_wait[pf0] + rs_wait[pf0]) = {(off['wall'] - on['wall']) / exposed:.0%})")
    if ("NO_SHARD", 1) in med and ("FULL_SHARD", 1) in med:
        ratio = med["FULL_SHARD", 1]["persistent"] / med["NO_SHARD", 1]["persistent"]
        print(f"FULL_SHARD holds {ratio:.3f} of NO_SHARD's persistent bytes per rank "
              f"(1/n = {1 / args.nprocs:.3f})")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_worker":
        asyncio.run(worker(json.loads(sys.argv[2]), sys.argv[3]))
    else:
        main()
