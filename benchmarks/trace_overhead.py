"""What tracing and the flight recorder cost a job (issue 33).

Three modes of the same job, each a fresh set of rank processes on 127.0.0.1 started by
``netdist.launcher.launch``:

``off``     ``NETDIST_FLIGHT_RECORDS=0``: no flight recorder (nothing recorded at all);
``flight``  the default: the flight recorder on (a record per collective), no trace;
``trace``   ``NETDIST_TRACE=DIR``: flight recorder and the full trace (every collective,
            every TCP send and receive), the per-rank files written at close.

Two jobs:

``all_reduce``  a loop of ``Group.all_reduce`` at each size, every call timed on rank 0
                (``--tcp`` sets ``NETDIST_SHM=0``: every byte over TCP, every message a
                traced send and receive, tracing's worst case);
``ddp``         a torch ``DistributedDataParallel`` step on backend ``netdist`` (an MLP,
                forward, backward with the all-reduce overlapped, SGD step).

Modes are interleaved: each round runs every mode once, the order rotating from round to
round, so all see the same background load; a mode's figure is the median over rounds of
its per-round median, and the overhead is against ``off`` from the same rounds. Also
printed: the trace's size per rank per thousand collectives.

    python benchmarks/trace_overhead.py all_reduce --rounds 5
    python benchmarks/trace_overhead.py ddp --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[1])
MODES = ("off", "flight", "trace")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


# -- the rank processes ------------------------------------------------------------------

def _all_reduce_worker(out: str, sizes: list[int], iters: int, warmup: int) -> None:
    import asyncio

    import numpy as np

    import netdist
    from netdist.collectives import Group

    async def run() -> dict[str, Any]:
        async with netdist.init() as transport:
            group = Group(transport)
            timings: dict[str, Any] = {}
            for size in sizes:
                array = np.ones(max(size // 4, 1), np.float32)
                for _ in range(warmup):
                    await group.all_reduce(array)
                await group.barrier()
                times = []
                for _ in range(iters):
                    began = time.perf_counter()
                    await group.all_reduce(array)
                    times.append(time.perf_counter() - began)
                timings[str(size)] = statistics.median(times)
            await group.barrier()
            return {"timings": timings, "collectives": transport.recorder.recorded}

    result = asyncio.run(run())
    if int(os.environ["NETDIST_RANK"]) == 0:
        Path(out).write_text(json.dumps(result))


def _ddp_worker(out: str, steps: int, warmup: int, widths: list[int], batch: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import netdist.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("netdist", init_method="env://")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, widths[0])
    y = torch.randn(batch, widths[-1])
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        began = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"timings": {"step": statistics.median(times)},
                                         "collectives": 0}))
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------

def _job(args: argparse.Namespace, mode: str, scratch: Path) -> tuple[dict[str, Any], int]:
    from netdist.launcher import launch

    out = scratch / f"{mode}.json"
    out.unlink(missing_ok=True)
    trace_dir = scratch / f"trace-{mode}"
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
           "NETDIST_FLIGHT_DIR": str(scratch / "flight")}
    if mode == "off":
        env["NETDIST_FLIGHT_RECORDS"] = "0"
    if mode == "trace":
        env["NETDIST_TRACE"] = str(trace_dir)
    if args.tcp:
        env["NETDIST_SHM"] = "0"
    if args.job == "ddp":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    worker = [sys.executable, __file__, "--worker", args.job, "--out", str(out),
              "--sizes", args.sizes, "--iters", str(args.iters), "--warmup",
              str(args.warmup), "--steps", str(args.steps), "--widths", args.widths,
              "--batch", str(args.batch)]
    code = launch(worker, args.ranks, env=env, prefix_output=True, timeout=600)
    if code != 0:
        raise SystemExit(f"{mode} job failed with exit status {code}")
    size = sum(p.stat().st_size for p in trace_dir.glob("rank_*.trace.json")) \
        if mode == "trace" else 0
    for path in trace_dir.glob("*"):
        path.unlink()
    return json.loads(out.read_text()), size


def recorder_cost(calls: int = 200_000) -> dict[str, float]:
    """Nanoseconds the recorder adds per collective call (flight recorder alone, and with
    the trace), and per traced message: the same bookkeeping the job does, timed in a
    tight loop on this process, so the figure has no scheduling noise in it."""
    from netdist.trace.recorder import Recorder
    from netdist.trace.settings import TraceSettings
    from netdist.trace.tracer import KIND_RECV

    cost: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as where:
        for label, flight, traced in (("none", 0, False), ("flight", 2000, False),
                                      ("trace", 2000, True)):
            recorder = Recorder(0, 4, settings=TraceSettings(flight_records=flight))
            recorder.register_group(7, (0, 1, 2, 3))
            if traced:
                recorder.start_trace(where)
            began = time.perf_counter_ns()
            for seq in range(calls):
                if flight or traced:
                    record = recorder.begin(7, seq, "all_reduce", 0, 4096, "ring")
                    recorder.end(record, "ok", 1)
            cost[label] = (time.perf_counter_ns() - began) / calls
            if traced:
                trace = recorder.trace
                began = time.perf_counter_ns()
                for seq in range(calls):
                    trace.add((KIND_RECV, seq, seq + 5, 1, 42, 4096, 2, 0, 0, 0))
                cost["message"] = (time.perf_counter_ns() - began) / calls
                recorder.trace.discard()
                recorder.trace = None
    return {"flight": cost["flight"] - cost["none"], "trace": cost["trace"] - cost["none"],
            "message": cost["message"]}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", nargs="?", choices=("all_reduce", "ddp"), default="all_reduce")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="4K,256K,4M", help="all_reduce sizes in bytes")
    parser.add_argument("--iters", type=int, default=300, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30, help="timed DDP steps per job")
    parser.add_argument("--widths", default="512,2048,2048,512")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tcp", action="store_true", help="NETDIST_SHM=0: all over TCP")
    parser.add_argument("--worker", choices=("all_reduce", "ddp"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    if args.worker == "all_reduce":
        _all_reduce_worker(args.out, sizes, args.iters, args.warmup)
        return 0
    if args.worker == "ddp":
        _ddp_worker(args.out, args.steps, args.warmup, widths, args.batch)
        return 0

    per_mode: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    trace_bytes: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory(prefix="netdist-trace-bench-") as scratch:
        for round_index in range(args.rounds):
            order = MODES[round_index % 3:] + MODES[:round_index % 3]
            for mode in order:
                result, size = _job(args, mode, Path(scratch))
                for key, seconds in result["timings"].items():
                    per_mode[mode].setdefault(key, []).append(seconds)
                if mode == "trace" and result["collectives"]:
                    trace_bytes.append((size, result["collectives"]))
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    what = ("DDP step" if args.job == "ddp" else
            f"all_reduce ({'TCP only' if args.tcp else 'shared memory on one host'})")
    print(f"trace overhead: {what}, {args.ranks} ranks, {args.rounds} interleaved rounds "
          "(median of per-round medians)")
    print(f"{'size':>10}  {'off':>11}  {'flight':>11}  {'trace':>11}  "
          f"{'flight cost':>11}  {'trace cost':>10}")
    for key in per_mode["off"]:
        med = {m: statistics.median(per_mode[m][key]) for m in MODES}
        label = key if args.job == "ddp" else _label(int(key))
        print(f"{label:>10}  {_time(med['off'])}  {_time(med['flight'])}  "
              f"{_time(med['trace'])}  {100 * (med['flight'] / med['off'] - 1):+10.2f}%  "
              f"{100 * (med['trace'] / med['off'] - 1):+9.2f}%")
    cost = recorder_cost()
    print(f"recorder cost, timed alone: flight recorder {cost['flight']:.0f} ns per "
          f"collective; tracing {cost['trace']:.0f} ns per collective + "
          f"{cost['message']:.0f} ns per traced send or receive")
    if trace_bytes:
        per_thousand = statistics.median(
            size / args.ranks / (count / 1000) for size, count in trace_bytes)
        print(f"trace size: {per_thousand / 1024:.0f} KiB per rank per 1000 collectives "
              "(all sends and receives included)")
    return 0


def _label(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:8.1f} us"


if __name__ == "__main__":
    raise SystemExit(main())
