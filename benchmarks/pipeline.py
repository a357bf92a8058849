"""Pipeline parallelism: measured bubble vs theory, and activation memory of GPipe vs 1F1B.

Two measurements, each printed as a table:

``bubble``  p stage processes (started with ``netdist.launcher.launch``, connected over
            real TCP on 127.0.0.1) train one mini-batch after another. Every stage reports
            ``1 - compute / wall`` for the pipeline phase of each step (the time it was not
            inside forward/backward/loss), the measured bubble, next to the theoretical
            ``(p - 1) / (m + p - 1)`` and the discrete-event simulation of the same schedule
            (``simul.``) with the measured per-micro-batch forward/backward times and a
            per-hop latency (``hop ms``) fitted on the m = 1 run. Per-micro-batch compute is constant
            as m grows (fixed rows per micro-batch), as the formula assumes.
            ``--compute numpy``: each stage runs real float64 Linear+Tanh layers (one BLAS
            thread per process), honest only while p <= free cores.
            ``--compute sleep``: each layer blocks its process for a fixed time per
            micro-batch, like an accelerator kernel the host waits on; honest for any p.
``memory``  one process, in-process transport: peak bytes of stashed activations (the
            forward contexts kept for backward) per stage, GPipe vs 1F1B, as m grows with
            a fixed micro-batch size. GPipe holds m micro-batches, 1F1B at most p - stage.

Run::

    python3 benchmarks/pipeline.py memory --stages 4
    python3 benchmarks/pipeline.py bubble --stages 2 --compute numpy
    python3 benchmarks/pipeline.py bubble --stages 2,3,4 --compute sleep
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

from netdist.parallel.pipeline import PipelineParallel  # noqa: E402
from netdist.parallel.schedule import (  # noqa: E402
    build_schedule,
    simulate,
    theoretical_bubble_fraction,
)
from netdist.parallel.stages import PipelineParallelConfig, split_into_stages  # noqa: E402


# -- models ------------------------------------------------------------------------------

class SleepLayer:
    """Blocks the process ``forward_s`` / ``backward_s`` per micro-batch (device model)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.forward_s = forward_s
        self.backward_s = backward_s

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, None]:
        time.sleep(self.forward_s)
        return x, None

    def backward(self, ctx: None, grad: np.ndarray) -> np.ndarray:
        time.sleep(self.backward_s)
        return grad

    def parameters(self) -> list[Any]:
        return []


def numpy_layers(num_stages: int, layers_per_stage: int, width: int) -> list[Any]:
    from netdist.train.nn import Linear, Tanh

    rng = np.random.default_rng(0)
    layers: list[Any] = []
    for _ in range(num_stages * layers_per_stage):
        layers += [Linear(width, width, rng=rng), Tanh()]
    return layers


def sum_squares(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """A cheap mean loss so the last stage's extra work stays negligible."""
    diff = pred - target
    return float(np.mean(diff * diff)), diff * (2.0 / diff.size)


# -- bubble: one worker process per stage --------------------------------------------------

async def worker(args: dict[str, Any], out_dir: str) -> None:
    try:
        from netdist import init
    except ImportError:  # pragma: no cover - before the top-level export lands
        from netdist.transport.bootstrap import init

    async with init() as transport:
        rank, p = transport.rank, transport.world_size
        results = []
        for schedule in args["schedules"]:
            for m in args["micro_batches"]:
                config = PipelineParallelConfig(p, m, schedule)
                if args["compute"] == "sleep":
                    layers = [SleepLayer(args["forward_ms"] / 1e3, args["backward_ms"] / 1e3)]
                    width = args["width"]
                else:
                    full = numpy_layers(p, args["layers_per_stage"], args["width"])
                    layers = split_into_stages(len(full), p)[rank].select(full)
                    width = args["width"]
                pipe = PipelineParallel(transport, layers, config, loss_fn=sum_squares,
                                        timeout=120.0, offload_compute=args["offload"])
                rows = args["rows"] * m
                rng = np.random.default_rng(rank)
                x = rng.standard_normal((rows, width))
                y = rng.standard_normal((rows, width))
                await transport.barrier(timeout=120.0)
                stats = []
                for step in range(args["warmup"] + args["steps"]):
                    await pipe.train_step(x, y)
                    if step >= args["warmup"]:
                        stats.append(pipe.last_stats)
                results.append({
                    "schedule": schedule, "m": m,
                    "idle": [s.idle_fraction for s in stats],
                    "wall": [s.wall_seconds for s in stats],
                    "compute": [s.compute_seconds for s in stats],
                    "forward": [s.forward_seconds for s in stats],
                    "backward": [s.backward_seconds for s in stats],
                    "peak_stashed": stats[-1].peak_stashed_micro_batches,
                })
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(results))
        await transport.barrier(timeout=120.0)


def run_bubble(stage_counts: list[int], micro_batches: list[int], compute: str,
               args: argparse.Namespace) -> None:
    from netdist.launcher import launch

    print(f"bubble: compute={compute} rows/micro-batch={args.rows} "
          f"{'width=%d layers/stage=%d' % (args.width, args.layers_per_stage) if compute == 'numpy' else 'forward=%.1fms backward=%.1fms' % (args.forward_ms, args.backward_ms)} "
          f"steps={args.steps} (median), offload={args.offload}, cores={os.cpu_count()}")
    print(f"{'sched':6} {'p':>2} {'m':>3} {'theory':>7} {'simul.':>7} {'measured (per stage)':>28}"
          f" {'mean':>6} {'step ms':>8} {'stash':>6} {'hop ms':>7}")
    for p in stage_counts:
        with tempfile.TemporaryDirectory() as out_dir:
            spec = {"schedules": ["gpipe", "1f1b"], "micro_batches": micro_batches,
                    "compute": compute, "rows": args.rows, "width": args.width,
                    "layers_per_stage": args.layers_per_stage, "forward_ms": args.forward_ms,
                    "backward_ms": args.backward_ms, "steps": args.steps,
                    "warmup": args.warmup, "offload": args.offload}
            env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                   "MKL_NUM_THREADS": "1"}
            code = launch([sys.executable, __file__, "_worker", json.dumps(spec), out_dir],
                          nprocs=p, env=env, timeout=1800)
            if code != 0:
                raise SystemExit(f"workers failed with exit code {code}")
            per_rank = [json.loads(Path(out_dir, f"rank_{r}.json").read_text())
                        for r in range(p)]
        latency: dict[str, float] = {}
        for index, first in enumerate(per_rank[0]):
            schedule, m = first["schedule"], first["m"]
            rows = [rank_results[index] for rank_results in per_rank]
            idle = [statistics.median(r["idle"]) for r in rows]
            wall = statistics.median(max(r["wall"][i] for r in rows)
                                     for i in range(len(rows[0]["wall"])))
            # simulate with the measured per-micro-batch forward/backward times of the
            # slowest stage and a per-hop latency fitted on the m = 1 run:
            # wall(m=1) = p (f + b) + 2 (p - 1) latency
            fwd = max(statistics.median(r["forward"]) for r in rows) / m
            bwd = max(statistics.median(r["backward"]) for r in rows) / m
            if m == 1 and p > 1:
                latency[schedule] = max(0.0, (wall - p * (fwd + bwd)) / (2 * (p - 1)))
            sim = simulate(build_schedule(schedule, p, m), forward_cost=fwd,
                           backward_cost=bwd, comm_cost=latency.get(schedule, 0.0))
            measured = " ".join(f"{v:5.3f}" for v in idle)
            print(f"{schedule:6} {p:>2} {m:>3} {theoretical_bubble_fraction(p, m):7.3f} "
                  f"{statistics.mean(sim.bubble_fractions):7.3f} {measured:>28} "
                  f"{statistics.mean(idle):6.3f} {wall * 1e3:8.1f} "
                  f"{max(r['peak_stashed'] for r in rows):6d} "
                  f"{latency.get(schedule, 0.0) * 1e3:7.2f}")


# -- memory: one process ----------------------------------------------------------------

async def measure_memory(p: int, micro_batches: list[int], rows: int,
                         width: int) -> list[tuple[str, int, list[int], list[int]]]:
    from netdist.transport.inprocess import InProcessTransport

    out = []
    for schedule in ("gpipe", "1f1b"):
        for m in micro_batches:
            config = PipelineParallelConfig(p, m, schedule)
            transports = InProcessTransport.create_group(p, timeout=60.0)
            full = numpy_layers(p, 1, width)
            stages = split_into_stages(len(full), p)
            pipes = [PipelineParallel(t, stages[t.rank].select(full), config,
                                      loss_fn=sum_squares, timeout=60.0) for t in transports]
            rng = np.random.default_rng(0)
            x = rng.standard_normal((rows * m, width))
            y = rng.standard_normal((rows * m, width))
            await asyncio.gather(*(pipe.train_step(x, y) for pipe in pipes))
            out.append((schedule, m,
                        [pipe.last_stats.peak_stash_bytes for pipe in pipes],  # type: ignore[union-attr]
                        [pipe.last_stats.peak_stashed_micro_batches for pipe in pipes]))  # type: ignore[union-attr]
            for t in transports:
                await t.aclose()
    return out


def run_memory(p: int, micro_batches: list[int], rows: int, width: int) -> None:
    results = asyncio.run(measure_memory(p, micro_batches, rows, width))
    one_mb = None
    print(f"memory: p={p}, {rows} rows x {width} float64 per micro-batch, one Linear+Tanh "
          f"per stage; peak stashed activations per stage")
    print(f"{'sched':6} {'m':>3} {'peak KiB per stage':>36} {'max KiB':>8} {'micro-batches':>16}")
    for schedule, m, peak_bytes, counts in results:
        if one_mb is None:
            one_mb = max(peak_bytes)
        per_stage = " ".join(f"{b / 1024:8.1f}" for b in peak_bytes)
        print(f"{schedule:6} {m:>3} {per_stage:>36} {max(peak_bytes) / 1024:8.1f} "
              f"{str(counts):>16}")


def parse_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "_worker":
        from netdist.cli.loop import run  # uvloop when installed, as the CLI does

        run(worker(json.loads(sys.argv[2]), sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    bubble = sub.add_parser("bubble", help="measured bubble over TCP vs theory")
    bubble.add_argument("--stages", type=parse_list, default=[2])
    bubble.add_argument("--micro-batches", type=parse_list, default=[1, 2, 4, 8])
    bubble.add_argument("--compute", choices=["numpy", "sleep"], default="numpy")
    bubble.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    bubble.add_argument("--width", type=int, default=384)
    bubble.add_argument("--layers-per-stage", type=int, default=2)
    bubble.add_argument("--forward-ms", type=float, default=5.0)
    bubble.add_argument("--backward-ms", type=float, default=5.0)
    bubble.add_argument("--steps", type=int, default=5)
    bubble.add_argument("--warmup", type=int, default=1)
    bubble.add_argument("--offload", action="store_true",
                        help="run forward/backward in a worker thread (offload_compute)")
    memory = sub.add_parser("memory", help="peak stashed activations, GPipe vs 1F1B")
    memory.add_argument("--stages", type=int, default=4)
    memory.add_argument("--micro-batches", type=parse_list, default=[1, 2, 4, 8, 16, 32])
    memory.add_argument("--rows", type=int, default=32)
    memory.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    if args.what == "bubble":
        run_bubble(args.stages, args.micro_batches, args.compute, args)
    else:
        run_memory(args.stages, args.micro_batches, args.rows, args.width)


if __name__ == "__main__":
    main()
