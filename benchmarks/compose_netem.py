"""Step time of ring all-reduce vs sync parameter server vs top-k across 4 containers.

Runs the docker-compose cluster (4 workers, one container each) once per network
condition and aggregator, with ``NETDIST_NETEM`` shaping every container, and reads the
per-epoch throughput rank 0 prints. The step time of an epoch is its global batch
(batch x 4) divided by its samples/s; a run's figure is the median over the epochs after
the first (which carries the warm-up), and the table shows the median over ``--repeats``
runs made in alternating order. Prints a table and writes a PNG plot.

    docker/build-offline.sh
    python3 benchmarks/compose_netem.py                      # both links, 3 aggregators, 2 runs each
    python3 benchmarks/compose_netem.py --hidden 512,512 --baseline --plot out.png

Conditions (every container's traffic shaped; a kernel without the netem qdisc gets the
entrypoint's emulation, see docker/netem.py):

- ``rate 1gbit delay 1ms``   a LAN
- ``rate 100mbit delay 10ms`` a slow WAN-ish link

Expectation to check (issue 8): top-k wins at 100 Mbit, ring wins at 1 Gbit.

Bounded: every cluster run has a wall-clock limit (``--run-timeout``) and the whole
benchmark stops starting new runs after ``--budget`` seconds. The machine's cores are
shared by all 4 containers, so compute is part of every step time: compare aggregators
within one condition, in one run of this script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.docker.cluster import (  # noqa: E402  (the path is set just above)
    EPOCH_RE,
    RANK0,
    WORKERS,
    Cluster,
    build_images,
    check_engine,
)

CONDITIONS = (("1 Gbit, 1 ms", "rate 1gbit delay 1ms"),
              ("100 Mbit, 10 ms", "rate 100mbit delay 10ms"))
BASELINE = ("unshaped", "")
AGGREGATORS = (("ring", "ring all-reduce"), ("ps", "sync PS (rank 0)"), ("topk", "top-k 1%"))
SAMPLES_RE = r"samples/s\s+([0-9,]+)\s+comm\s+([0-9.]+)%"


def run_one(netem: str, aggregator: str, args: argparse.Namespace) -> dict[str, float]:
    """One cluster run; ``{"step_ms", "comm"}`` (medians over epochs 2..E)."""
    import re

    env = {
        "NETDIST_NETEM": netem,
        "NETDIST_AGGREGATOR": aggregator,
        "NETDIST_EPOCHS": str(args.epochs),
        "NETDIST_BATCH_SIZE": str(args.batch_size),
        "NETDIST_CHECKPOINT_DIR": "none",
        "NETDIST_TIMEOUT": "120",
        "NETDIST_WORKER_ARGS": f"--hidden {args.hidden} --topk-ratio {args.topk_ratio}",
    }
    cluster = Cluster(f"bench{aggregator}", env)
    try:
        cluster.up()
        exits = cluster.wait_exit(WORKERS, args.run_timeout)
        log = cluster.logs(RANK0)
        failed = {s: e.code for s, e in exits.items() if e.code != 0}
        if failed:
            raise RuntimeError(f"{aggregator} under '{netem}': containers failed {failed}\n"
                               f"{log[-3000:]}")
    finally:
        cluster.down()
    step_ms, comm = [], []
    for line in log.splitlines():
        epoch = EPOCH_RE.search(line)
        rate = re.search(SAMPLES_RE, line)
        if epoch and rate and int(epoch.group(1)) >= 2:
            samples_per_s = float(rate.group(1).replace(",", ""))
            step_ms.append(args.batch_size * len(WORKERS) / samples_per_s * 1e3)
            comm.append(float(rate.group(2)))
    if not step_ms:
        raise RuntimeError(f"no progress lines after epoch 1 in rank 0's log:\n{log[-3000:]}")
    return {"step_ms": statistics.median(step_ms), "comm": statistics.median(comm)}


def plot(results: dict[tuple[str, str], dict[str, float]], path: Path,
         conditions: tuple[tuple[str, str], ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(AGGREGATORS)
    for i, (agg, label) in enumerate(AGGREGATORS):
        xs, ys = [], []
        for j, (cond, _) in enumerate(conditions):
            if (cond, agg) in results:
                xs.append(j + (i - (len(AGGREGATORS) - 1) / 2) * width)
                ys.append(results[(cond, agg)]["step_ms"])
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(conditions)), [c for c, _ in conditions])
    ax.set_ylabel("median step time (ms)")
    ax.set_title("netdist demo, 4 containers: step time by aggregator and link")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--hidden", default="128,64",
                        help="MLP hidden sizes; bigger means more bytes per step (default "
                             "128,64, the demo's model: 17k parameters, 67 KiB of gradients)")
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--run-timeout", type=float, default=300.0,
                        help="wall-clock limit per cluster run, seconds (default 300)")
    parser.add_argument("--budget", type=float, default=1200.0,
                        help="start no new run after this many seconds (default 1200)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per aggregator and link, in alternating order (default 2)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run without shaping (compute and bridge cost alone)")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "compose_netem.png")
    parser.add_argument("--no-build", action="store_true",
                        help="use the existing netdist:local image")
    args = parser.parse_args(argv)

    check_engine()
    if not args.no_build:
        build_images()
    conditions = (BASELINE, *CONDITIONS) if args.baseline else CONDITIONS
    start = time.monotonic()
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    out_of_budget = False
    for repeat in range(args.repeats):
        # alternate the order between repeats so that a noisy neighbour's burst does not
        # always land on the same aggregator
        order = AGGREGATORS[repeat % len(AGGREGATORS):] + AGGREGATORS[:repeat % len(AGGREGATORS)]
        for cond, netem in conditions:
            for agg, _ in order:
                if time.monotonic() - start > args.budget:
                    out_of_budget = True
                    break
                t = time.monotonic()
                run = run_one(netem, agg, args)
                runs.setdefault((cond, agg), []).append(run)
                print(f"  run {repeat + 1}/{args.repeats}  {cond:<16} {agg:<5} "
                      f"{run['step_ms']:8.1f} ms/step ({time.monotonic() - t:.0f} s)",
                      file=sys.stderr, flush=True)
    if out_of_budget:
        print(f"budget of {args.budget:g} s spent; some runs were skipped", file=sys.stderr)
    results = {key: {"step_ms": statistics.median(r["step_ms"] for r in values),
                     "comm": statistics.median(r["comm"] for r in values),
                     "spread": (max(r["step_ms"] for r in values)
                                - min(r["step_ms"] for r in values)),
                     "n": len(values)}
               for key, values in runs.items()}

    print(f"\nstep time, 4 containers, MLP 64-{args.hidden.replace(',', '-')}-10, batch "
          f"{args.batch_size}/rank, median of epochs 2..{args.epochs}, median of "
          f"{args.repeats} runs ({os.cpu_count()} CPUs shared)\n")
    header = f"{'link':<18}" + "".join(f"{label:>22}" for _, label in AGGREGATORS) + "   fastest"
    print(header)
    print("-" * len(header))
    for cond, _ in conditions:
        row = {agg: results[(cond, agg)] for agg, _ in AGGREGATORS if (cond, agg) in results}
        cells = "".join(
            f"{row[agg]['step_ms']:>10.1f} ms ({row[agg]['comm']:>3.0f}% c)" if agg in row
            else f"{'-':>22}" for agg, _ in AGGREGATORS)
        best = min(row, key=lambda a: row[a]["step_ms"]) if row else "-"
        print(f"{cond:<18}{cells}   {best}")
    print("\n(c = share of the step spent in the aggregator, as rank 0 reports it; "
          "max - min over runs:")
    for (cond, agg), r in sorted(results.items()):
        print(f"   {cond:<16} {agg:<5} n={r['n']:.0f} spread {r['spread']:.1f} ms")
    print(")")
    slow = {a: results.get((CONDITIONS[1][0], a)) for a, _ in AGGREGATORS}
    fast = {a: results.get((CONDITIONS[0][0], a)) for a, _ in AGGREGATORS}
    if all(slow.values()) and all(fast.values()):
        topk_wins = min(slow, key=lambda a: slow[a]["step_ms"]) == "topk"  # type: ignore[index]
        ring_wins = min(fast, key=lambda a: fast[a]["step_ms"]) == "ring"  # type: ignore[index]
        print(f"expectation: top-k fastest at 100 Mbit: {'yes' if topk_wins else 'NO'}; "
              f"ring fastest at 1 Gbit: {'yes' if ring_wins else 'NO'}")
    plot(results, args.plot, conditions)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
