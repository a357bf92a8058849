"""How long a parameter-server shard's failover holds the workers, and that it loses nothing.

Each run starts a real job on 127.0.0.1: ``--servers`` ``netdist ps-server`` ranks with
``--replicas 1`` (every shard has a backup on the next server) and ``--workers`` worker
processes (this script with ``--worker``) training asynchronously (``--max-staleness``,
default ``none``) on parameter-independent gradients whose sums are exact in float64, so
the final parameters have one exact value whatever order the pushes applied in. Once
worker 0 has had ``--kill-at`` steps acknowledged, the primary of shard ``--victim`` is
SIGKILLed; every worker records the wall-clock time of each acknowledged step.

Reported per run and worker: **blocked**, the time from the kill to that worker's next
acknowledged step (the failover as the worker feels it: loss detection, retry on the
backup), next to the median step time before the kill for scale; and whether the final
parameters equal the exact result of applying every push once (no acknowledged update
lost, no retried push applied twice). Exits 1 if any run lost or repeated an update.

    python benchmarks/ps_failover.py                     # 3 runs, 2 servers, 2 workers
    python benchmarks/ps_failover.py --repeats 5 --kib 1024 --json failover.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

LR = 0.5


def _grads(sizes: list[int], worker: int, step: int) -> list[Any]:
    """Multiples of 3/8: divided by up to 3 workers and scaled by LR, sums stay exact."""
    import numpy as np

    return [3.0 * ((np.arange(n) + 7 * worker + 3 * step) % 5 + 1) / 8.0 for n in sizes]


def _sizes(kib: float) -> list[int]:
    total = max(64, int(kib * 1024) // 8)
    return [total // 4, total - total // 4]  # a small tensor and a large sliced one


def _digest(params: list[Any]) -> str:
    import numpy as np

    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).tobytes())
    return h.hexdigest()


def _expected(sizes: list[int], workers: int, steps: int) -> str:
    import numpy as np

    params = [np.zeros(n) for n in sizes]
    for w in range(workers):
        for t in range(steps):
            for p, g in zip(params, _grads(sizes, w, t)):
                p -= LR * (g / workers)
    return _digest(params)


# -- worker ------------------------------------------------------------------------------


async def _work(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.ps import PSClient, SGDConfig, num_servers_from_env
    from netdist.ps import replicas_from_env
    from netdist.transport.bootstrap import init

    servers = num_servers_from_env()
    sizes = _sizes(args.kib)
    async with init() as transport:
        index = transport.rank - servers
        acks: list[float] = []
        async with PSClient(transport, num_servers=servers,
                            replicas=replicas_from_env()) as client:
            params = await client.init([np.zeros(n) for n in sizes],
                                       optimizer=SGDConfig(lr=LR),
                                       max_staleness=args.max_staleness,
                                       bigarray_bound=max(sizes) // 2)
            for step in range(args.steps):
                params = await client.step(_grads(sizes, index, step))
                acks.append(time.time())
                print(f"STEP {index} {step}", flush=True)
        Path(args.worker, f"worker{index}.json").write_text(json.dumps({
            "acks": acks, "versions": list(client.versions), "digest": _digest(params),
            "failovers": client.failovers}))


# -- driver ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_once(args: argparse.Namespace, outdir: Path) -> dict[str, Any]:
    world = args.servers + args.workers
    port, token = _free_port(), secrets.token_hex(16)
    staleness = "none" if args.max_staleness is None else str(args.max_staleness)
    worker_cmd = [sys.executable, HERE, "--worker", str(outdir), "--steps", str(args.steps),
                  "--kib", str(args.kib), "--max-staleness", staleness]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
        env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(world),
                   NETDIST_COORDINATOR=f"127.0.0.1:{port}", NETDIST_TOKEN=token,
                   NETDIST_JOB_ID=f"failover-{token[:6]}", NETDIST_TIMEOUT="30",
                   PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "netdist.cli.ps_server", "--num-servers",
             str(args.servers), "--replicas", "1", "--", *worker_cmd],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    killed_at = 0.0
    try:
        first = procs[args.servers]
        assert first.stdout is not None
        deadline = time.monotonic() + 120
        for line in first.stdout:  # worker 0's acknowledged steps
            if line.startswith(f"STEP 0 {args.kill_at - 1}"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("worker 0 did not reach the kill step in 120 s")
        killed_at = time.time()
        procs[args.victim].send_signal(signal.SIGKILL)
        outputs = {}
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=120)
            outputs[rank] = (proc.returncode, out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for rank, (code, out) in outputs.items():
        if rank != args.victim and code != 0:
            raise RuntimeError(f"rank {rank} exited {code}:\n{out}")
    results = [json.loads((outdir / f"worker{w}.json").read_text())
               for w in range(args.workers)]
    blocked, step_times = [], []
    for result in results:
        acks = result["acks"]
        before = [a for a in acks if a <= killed_at]
        after = [a for a in acks if a > killed_at]
        blocked.append(after[0] - killed_at if after else float("nan"))
        gaps = [b - a for a, b in zip(before, before[1:])]
        step_times.append(statistics.median(gaps) if gaps else float("nan"))
    last = max(results, key=lambda r: r["versions"])
    exact = last["digest"] == _expected(_sizes(args.kib), args.workers, args.steps)
    if args.max_staleness is None:
        exact = exact and last["versions"] == [args.workers * args.steps] * args.servers
    return {"blocked_s": blocked, "step_s": step_times, "exact": exact,
            "versions": last["versions"], "failovers": [r["failovers"] for r in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=20,
                        help="kill once worker 0 has this many steps acknowledged")
    parser.add_argument("--victim", type=int, default=0, help="server rank to SIGKILL")
    parser.add_argument("--kib", type=float, default=256.0,
                        help="parameters in KiB of float64 (default 256)")
    parser.add_argument("--max-staleness", type=lambda t: None if t == "none" else int(t),
                        default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        import asyncio

        asyncio.run(_work(args))
        return 0
    if not 0 <= args.victim < args.servers or not 0 < args.kill_at < args.steps:
        parser.error("--victim must be a server rank and --kill-at within --steps")
    mode = "async" if args.max_staleness is None else f"max_staleness={args.max_staleness}"
    print(f"ps failover: {args.servers} servers (replicas 1), {args.workers} workers, "
          f"{args.kib:g} KiB float64, {mode}, {args.steps} steps; SIGKILL server rank "
          f"{args.victim} after {args.kill_at} acknowledged steps of worker 0")
    print(f"{'run':>3}  {'worker':>6}  {'blocked (s)':>11}  {'step before (s)':>15}  "
          f"{'final version':>13}  exact")
    runs = []
    for run in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            result = _run_once(args, Path(tmp))
        runs.append(result)
        for w, (blocked, step) in enumerate(zip(result["blocked_s"], result["step_s"])):
            print(f"{run:>3}  {w:>6}  {blocked:>11.4f}  {step:>15.4f}  "
                  f"{str(result['versions']):>13}  {result['exact']}")
    worst = max(b for r in runs for b in r["blocked_s"])
    ok = all(r["exact"] for r in runs)
    print(f"worst blocked time {worst:.4f} s over {len(runs)} runs; every acknowledged "
          f"update kept and none applied twice: {ok}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "worker")},
                                         "runs": runs}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
