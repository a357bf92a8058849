"""Tensor parallelism: a column -> ReLU -> row MLP block step against the block unsharded.

One job of ``max(--tp)`` rank processes (``netdist.launcher.launch``, real TCP on
127.0.0.1, shared memory off so every byte crosses a socket and the transport's counters
see it, one BLAS thread each) trains the same float32 block
``Linear(width, hidden) -> ReLU -> Linear(hidden, width)`` (mean-squared error, SGD)
under each variant in turn, interleaved step by step so that a slower moment of the
machine hits every variant alike:

``unsharded``  rank 0 alone, the whole block on the whole batch (the others wait);
``tp N``       ranks 0..N-1: ``ColumnParallelLinear -> ReLU -> RowParallelLinear``, each
               rank a 1/N slice of both weights, the batch replicated; one all-reduce of
               the (batch, width) output forward, one of the input gradient backward;
``dp N``       ranks 0..N-1: the whole block on 1/N of the batch each, then one
               all-reduce (mean) of all the gradients, flattened (the data-parallel
               baseline: its bytes grow with the parameters, TP's with the activations).

Per variant the table shows the median over the measured steps of the slowest
participating rank's step time (zero_grad + forward + loss + backward [+ gradient
all-reduce] + SGD step) and the payload bytes each participating rank sent per step
(``transport.traffic()``). For each TP size the script then checks that a TP step's
bytes are exactly those of two reference all-reduces on the same group, one of the
output's shape and one of the input's ("one all-reduce each way: yes").

On a 2-core machine 4 ranks share 2 cores, so TP cannot be faster than the unsharded
block there: the figures show what the split costs in time and bytes, not a speed-up.

Run::

    python3 benchmarks/tensor_parallel.py                 # TP=2 and 4, width 1024
    python3 benchmarks/tensor_parallel.py --quick         # a tiny block, seconds
    python3 benchmarks/tensor_parallel.py --width 2048 --hidden 8192 --batch 128
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMEOUT = 600.0
BLAS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def variants(tp_sizes: list[int], dp: bool) -> list[tuple[str, str, int]]:
    """``(label, kind, ranks)`` in the order each round runs them."""
    out = [("unsharded", "unsharded", 1)]
    for n in tp_sizes:
        out.append((f"tp {n}", "tp", n))
        if dp:
            out.append((f"dp {n}", "dp", n))
    return out


def build(kind: str, spec: dict[str, Any], group: Any) -> Any:
    """The block for ``kind``: plain layers, or tensor-parallel ones cut from them."""
    from netdist.parallel import ColumnParallelLinear, RowParallelLinear
    from netdist.train import Linear, ReLU, Sequential

    rng = np.random.default_rng(0)  # the same whole block on every rank and variant
    first = Linear(spec["width"], spec["hidden"], rng=rng, dtype=np.float32)
    second = Linear(spec["hidden"], spec["width"], rng=rng, dtype=np.float32)
    if kind != "tp":
        return Sequential(first, ReLU(), second)
    return Sequential(ColumnParallelLinear.from_linear(first, group), ReLU(),
                      RowParallelLinear.from_linear(second, group))


def step(model: Any, optimizer: Any, x: np.ndarray, target: np.ndarray,
         dp_group: Any) -> None:
    """One training step; ``dp_group``: average the gradients over it before the update."""
    from netdist.train import mse_loss

    model.zero_grad()
    y, ctx = model.forward(x)
    _, grad = mse_loss(y, target)
    model.backward(ctx, grad)
    if dp_group is not None:
        params = model.parameters()
        flat = np.concatenate([p.grad.ravel() for p in params])
        dp_group.all_reduce(flat, op="mean")
        offset = 0
        for p in params:
            p.grad[...] = flat[offset:offset + p.grad.size].reshape(p.grad.shape)
            offset += p.grad.size
    optimizer.step()


def worker(spec: dict[str, Any], out_dir: str) -> None:
    import netdist
    from netdist.collectives import Group
    from netdist.train import SGD

    with netdist.connect() as job:
        world = job.make(Group, job.transport, shared_memory=False)
        rank = job.rank
        groups = {n: world.new_group(list(range(n))) for n in sorted(set(spec["tp"]))}
        plan = variants(spec["tp"], spec["dp"])
        models: dict[str, tuple[Any, Any, Any]] = {}
        for label, kind, n in plan:
            if rank < n:
                group = groups.get(n)
                model = build(kind, spec, group)
                models[label] = (model, SGD(model.parameters(), lr=0.01),
                                 group if kind == "dp" else None)
        batch, width = spec["batch"], spec["width"]
        data = np.random.default_rng(1)
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in plan}
        for round_ in range(spec["warmup"] + spec["steps"]):
            x = data.standard_normal((batch, width)).astype(np.float32)
            target = data.standard_normal((batch, width)).astype(np.float32)
            for label, kind, n in plan:
                world.barrier()
                if rank >= n:
                    continue
                rows = slice(rank * batch // n, (rank + 1) * batch // n) if kind == "dp" \
                    else slice(None)
                model, optimizer, dp_group = models[label]
                before = job.transport.traffic()
                started = time.perf_counter()
                step(model, optimizer, x[rows], target[rows], dp_group)
                wall = time.perf_counter() - started
                sent = (job.transport.traffic() - before).total.sent_bytes
                if round_ >= spec["warmup"]:
                    results[label].append({"time": wall, "sent": sent})
        checks = {}
        for n in sorted(set(spec["tp"])):
            world.barrier()
            if rank < n:
                checks[n] = one_all_reduce_each_way(job, groups[n], models[f"tp {n}"][0],
                                                    spec)
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(
            {"results": results, "checks": {str(k): v for k, v in checks.items()}}))
        world.barrier()


def one_all_reduce_each_way(job: Any, group: Any, model: Any, spec: dict[str, Any]) -> bool:
    """Whether a TP forward and backward send exactly the payload bytes and messages of
    one all-reduce of the output's shape and one of the input's, on the same group."""
    x = np.ones((spec["batch"], spec["width"]), np.float32)

    def sent(fn: Any) -> tuple[int, int]:
        group.barrier()
        before = job.transport.traffic()
        fn()
        window = (job.transport.traffic() - before).total
        return window.sent_bytes, window.sent_messages

    holder: dict[str, Any] = {}

    def forward() -> None:
        holder["y"], holder["ctx"] = model.forward(x)

    forward_sent = sent(forward)
    backward_sent = sent(lambda: model.backward(holder["ctx"], np.ones_like(holder["y"])))
    reference_out = sent(lambda: group.all_reduce(np.ones_like(holder["y"])))
    reference_in = sent(lambda: group.all_reduce(np.ones_like(x)))
    return forward_sent == reference_out and backward_sent == reference_in


def summarize(per_rank: list[dict[str, Any]], plan: list[tuple[str, str, int]]
              ) -> list[dict[str, Any]]:
    rows = []
    for label, kind, n in plan:
        runs = [per_rank[r]["results"][label] for r in range(n)]
        steps = len(runs[0])
        rows.append({
            "label": label, "kind": kind, "ranks": n,
            "time": statistics.median(max(run[i]["time"] for run in runs)
                                      for i in range(steps)),
            "sent_per_rank": statistics.median(run[i]["sent"] for run in runs
                                               for i in range(steps)),
            "check": (per_rank[0]["checks"][str(n)] and
                      all(r["checks"][str(n)] for r in per_rank[:n])) if kind == "tp"
            else None,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="2,4", help="tensor-parallel sizes (comma-separated)")
    parser.add_argument("--width", type=int, default=1024, help="block input and output")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden features")
    parser.add_argument("--batch", type=int, default=64, help="rows per step (global)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-dp", action="store_true", help="skip the data-parallel rows")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny block, 2 measured steps: checks that everything runs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.width, args.hidden, args.batch, args.steps, args.warmup = 32, 128, 16, 2, 1
    tp_sizes = sorted({int(s) for s in args.tp.split(",") if s.strip()})
    if not tp_sizes or min(tp_sizes) < 2:
        parser.error(f"--tp needs sizes >= 2, got {args.tp!r}")
    spec = {"tp": tp_sizes, "dp": not args.no_dp, "width": args.width,
            "hidden": args.hidden, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup}
    nprocs = max(tp_sizes)
    from netdist.launcher import launch

    env = dict(BLAS_ENV, NETDIST_TIMEOUT=str(TIMEOUT))
    with tempfile.TemporaryDirectory() as out_dir:
        code = launch([sys.executable, __file__, "_worker", json.dumps(spec), out_dir],
                      nprocs=nprocs, env=env, timeout=3600)
        if code != 0:
            raise SystemExit(f"workers failed with exit code {code}")
        per_rank = [json.loads(Path(out_dir, f"rank_{r}.json").read_text())
                    for r in range(nprocs)]
    plan = variants(tp_sizes, spec["dp"])
    rows = summarize(per_rank, plan)
    params = 2 * args.width * args.hidden + args.hidden + args.width
    print(f"tensor_parallel: {nprocs} ranks over TCP on 127.0.0.1 (shared memory off), "
          f"{os.cpu_count()} cores, block Linear({args.width}, {args.hidden}) -> ReLU -> "
          f"Linear({args.hidden}, {args.width}) float32 = {params / 1e6:.2f} M params, "
          f"batch {args.batch}, SGD, {args.steps} steps after {args.warmup} warm-up"
          + (" (quick)" if args.quick else ""))
    activation = args.batch * args.width * 4
    print(f"one all-reduce each way moves an activation of {activation} bytes "
          f"({args.batch} x {args.width} float32); dp all-reduces {params * 4} bytes "
          f"of gradients")
    print(f"{'variant':10} {'ranks':>5} {'step ms':>9} {'sent B/rank':>12} "
          f"{'one all-reduce each way':>24}")
    for row in rows:
        check = "-" if row["check"] is None else ("yes" if row["check"] else "NO")
        print(f"{row['label']:10} {row['ranks']:>5} {row['time'] * 1e3:9.2f} "
              f"{row['sent_per_rank']:>12.0f} {check:>24}")
    if args.json is not None:
        args.json.write_text(json.dumps({"quick": args.quick, "spec": spec, "rows": rows},
                                        indent=2))
    if any(row["check"] is False for row in rows):
        raise SystemExit("a TP step did not move exactly one all-reduce each way")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
