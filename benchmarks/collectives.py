"""Every netdist collective at several world sizes, repeated, medians reported.

Runs ``netdist bench OP -n N`` (real processes over TCP on 127.0.0.1) ``--repeats``
times per (op, world size) and prints one nccl-tests-style table per pair with the
median over repeats of each size's median time, plus busbw. Other processes share the
cores, so repeats and medians matter; the exact command is printed with the results.

    python benchmarks/collectives.py                          # defaults below
    python benchmarks/collectives.py --ops all_reduce --world-sizes 2,4 \\
        --sizes 8,1M,16M,64M,256M --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from netdist.collectives.benchmark import BenchRow, busbw_factor, format_table  # noqa: E402


def _run_once(op: str, n: int, args: argparse.Namespace, path: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "netdist.cli.bench", op, "-n", str(n), "--sizes", args.sizes,
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", path]
    if args.small_message_bytes is not None:
        cmd += ["--small-message-bytes", str(args.small_message_bytes)]
    if args.segment_bytes is not None:
        cmd += ["--segment-bytes", str(args.segment_bytes)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.child_timeout)
    if proc.returncode != 0:
        print(f"# {op} n={n} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}",
              file=sys.stderr)
        return []
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,broadcast,barrier")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="8,64K,1M,16M,64M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-message-bytes", default=None)
    parser.add_argument("--segment-bytes", default=None)
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    print("# command: " + " ".join([os.path.relpath(HERE, REPO), *(argv or sys.argv[1:])]))
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
            for n in (int(x) for x in args.world_sizes.split(",")):
                runs = [_run_once(op, n, args, os.path.join(tmp, f"{op}-{n}-{i}.json"))
                        for i in range(args.repeats)]
                by_size: dict[int, list[dict[str, Any]]] = {}
                for rows in runs:
                    for row in rows:
                        by_size.setdefault(row["size"], []).append(row)
                merged = []
                for size, rows in sorted(by_size.items()):
                    med = statistics.median(r["time_median_us"] for r in rows)
                    algbw = size / (med * 1e-6) / 1e9 if med and size else 0.0
                    checks = sorted({r["check"] for r in rows})
                    merged.append(BenchRow(
                        op, n, size, rows[0]["count"], rows[0]["dtype"], rows[0]["iters"],
                        med, min(r["time_min_us"] for r in rows),
                        max(r["time_max_us"] for r in rows), algbw,
                        algbw * busbw_factor(op, n), ",".join(checks)))
                print()
                print(format_table(merged, f"{op}, {n} ranks: median of {len(runs)} runs x "
                                           f"{args.iters} iterations (min/max over all)"),
                      flush=True)
                report.extend(merged)
    if args.json:
        from dataclasses import asdict

        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([asdict(r) for r in report], fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
