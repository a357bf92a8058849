"""Elastic training under failures: recovery bounds, replacement speed, overhead, chaos.

Every run is a real job under ``netdist launch --elastic`` on 127.0.0.1 (the launcher
restarts only the slot that died); each member is this script's ``member`` mode: a
data-parallel job whose step computes for ``--step-seconds`` (a sleep standing in for the
forward and backward of a model that long: the CPUs stay free for the transport, as they
would with an accelerator), all-reduces a gradient and the step's sample counts, and
commits. The state holds the parameters, the per-epoch sample counts and ``--state-mb``
of further tensors (optimizer state, embeddings) that a replacement must fetch. Each
member appends one JSON line per committed step (wall time, step, epoch, members, a
digest of its parameters and counts) to its log; the driver reads the logs.

``failover`` (issue targets 1-3): 8 ranks, ~1 s steps; SIGKILL slot 3, then (once the
replacement is in) slot 0, the first member, which leads the agreements. Prints, per
kill: the time from the kill to the survivors' next commit, the steps lost, and the
replacement's time from its process start to its first committed step, with the rate
and donor count of its state fetch; then whether every member's digest agreed at every
step and which slots the launcher restarted.

``overhead`` (target 4): the same job without failures, elastic and plain (``netdist
launch`` with the same step on ``netdist.connect``), interleaved; mean step time.

``chaos`` (target 5): ``--events`` random failures (SIGKILL of one or two members, the
first member included, or SIGSTOP of one for longer than the failure timeout, then
SIGCONT) in one long run; after each, waits (bounded: a hang fails the run) until all
members train again. Checks that every member's digest agreed at every step boundary and
that every sample was used exactly once per data epoch.

    python benchmarks/elastic.py failover
    python benchmarks/elastic.py overhead --repeats 2
    python benchmarks/elastic.py chaos --events 100
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a replacement's clock starts with its process

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SAMPLES = 4096
GRAD = 1 << 18
EPOCHS_MAX = 512


# -- the member -----------------------------------------------------------------------------

def _member(plain: bool) -> int:
    from netdist.elastic import ElasticSampler, ElasticState

    out = Path(os.environ["BENCH_DIR"])
    steps = int(os.environ["BENCH_STEPS"])
    step_seconds = float(os.environ["BENCH_STEP_SECONDS"])
    batch = int(os.environ.get("BENCH_BATCH", "256"))
    state_mb = int(os.environ.get("BENCH_STATE_MB", "0"))
    until_world = int(os.environ.get("BENCH_UNTIL_WORLD", "0"))
    slot = int(os.environ.get("NETDIST_ELASTIC_SLOT", os.environ.get("NETDIST_RANK", "0")))
    rng = np.random.default_rng(11)
    coef = rng.standard_normal(SAMPLES)
    base = rng.standard_normal(GRAD).astype(np.float32)
    params = np.zeros(GRAD, dtype=np.float32)
    used = np.zeros((EPOCHS_MAX, SAMPLES), dtype=np.int64)
    bulk = (np.random.default_rng(5).integers(0, 255, state_mb << 20, dtype=np.uint8)
            if state_mb else np.zeros(1, dtype=np.uint8))
    sampler = ElasticSampler(SAMPLES, batch, seed=4)
    log = open(out / f"slot{slot}.{os.getpid()}.jsonl", "a", buffering=1)
    log.write(json.dumps({"event": "start", "t": STARTED, "pid": os.getpid(),
                          "restart": int(os.environ.get("NETDIST_RESTART_COUNT", "0"))}) + "\n")

    def digest() -> str:
        return hashlib.blake2b(params.tobytes() + used.tobytes(), digest_size=8).hexdigest()

    def compute(ids: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        payload = np.zeros(GRAD + SAMPLES)
        payload[:GRAD] = base * coef[ids].sum() + 1e-3 * len(ids) * params
        np.add.at(payload[GRAD:], ids, 1.0)
        spare = step_seconds - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)  # the model's forward and backward, on an accelerator
        return payload

    def apply(total: np.ndarray, count: int, data_epoch: int) -> None:
        params[:] = params - np.float32(0.01) * (total[:GRAD] / count).astype(np.float32)
        used[data_epoch] += total[GRAD:].astype(np.int64)

    def record(step: int, epoch: int, world: int, began: float, **extra: Any) -> None:
        log.write(json.dumps({"t": time.time(), "step": step, "epoch": epoch, "world": world,
                              "digest": digest(), "seconds": time.perf_counter() - began,
                              **extra}) + "\n")

    if plain:
        import netdist

        with netdist.connect() as fixed:
            while sampler.data_epoch * SAMPLES + sampler.cursor < steps * batch:
                began = time.perf_counter()
                ids = sampler.batch(fixed.rank, fixed.world_size)
                count = len(sampler.global_ids())
                total = fixed.group.all_reduce(compute(ids))
                apply(total, count, sampler.data_epoch)
                sampler.advance()
                record(sampler.data_epoch * SAMPLES + sampler.cursor, 0, fixed.world_size,
                       began)
        return 0

    import netdist.elastic as elastic

    state = ElasticState({"params": params, "used": used, "bulk": bulk})
    with elastic.connect(state, sampler=sampler) as job:
        joined = job.step
        change = job.job.changes[0]
        if change.sync is not None and change.sync.fetched_bytes:
            log.write(json.dumps({"event": "fetched", "bytes": change.sync.fetched_bytes,
                                  "seconds": change.sync.fetch_seconds,
                                  "donors": len(change.sync.donors)}) + "\n")
        stop_at = out / "stop_at"
        while job.step < steps or job.world_size < until_world or job.step == joined:
            if stop_at.exists():  # written well ahead of every member's step (chaos)
                steps = int(stop_at.read_text() or steps)
                if job.step >= steps and job.step != joined:
                    break
            began = time.perf_counter()

            def step_fn(ctx: elastic.BlockingStepContext) -> None:
                ids = ctx.batch
                assert ids is not None
                total = ctx.all_reduce(compute(ids))
                data_epoch = sampler.data_epoch
                ctx.on_commit(lambda: apply(total, ctx.global_count, data_epoch))

            job.run_step(step_fn)
            record(job.step, job.epoch, job.world_size, began, resumed=job.job.resumed,
                   discarded=job.job.discarded)
        np.savez(out / f"slot{slot}.{os.getpid()}.final.npz", used=used,
                 data_epoch=sampler.data_epoch, cursor=sampler.cursor,
                 deferred=len(sampler.deferred), step=job.step)
    return 0


# -- the driver -----------------------------------------------------------------------------

class Run:
    """One ``netdist launch`` job and its members' logs."""

    def __init__(self, ranks: int, *, steps: int, step_seconds: float, state_mb: int = 0,
                 elastic: bool = True, until_world: int = 0, failure_timeout: float = 2.0,
                 max_restarts: int = 3, timeout: float = 900.0, batch: int = 256) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="netdist-elastic-"))
        env = {**os.environ, "BENCH_DIR": str(self.dir), "BENCH_STEPS": str(steps),
               "BENCH_STEP_SECONDS": str(step_seconds), "BENCH_STATE_MB": str(state_mb),
               "BENCH_UNTIL_WORLD": str(until_world), "BENCH_BATCH": str(batch),
               "NETDIST_ELASTIC_TIMEOUT": str(failure_timeout), "PYTHONPATH": REPO}
        cmd = [sys.executable, "-m", "netdist", "launch", "-n", str(ranks), "--timeout",
               str(timeout), "--no-prefix"]
        if elastic:
            cmd += ["--elastic", "--max-restarts", str(max_restarts)]
        cmd += ["--", sys.executable, HERE, "member"] + ([] if elastic else ["--plain"])
        self.stderr = open(self.dir / "launch.err", "w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=self.stderr)

    def lines(self) -> dict[str, list[dict[str, Any]]]:
        """Every member process's log lines, by log file stem (slot.pid)."""
        out = {}
        for path in self.dir.glob("slot*.jsonl"):
            text = path.read_text()
            out[path.stem] = [json.loads(line) for line in text.splitlines()
                              if line.endswith("}")]
        return out

    def steps(self) -> list[dict[str, Any]]:
        """Every committed-step line of every process, with its slot and pid."""
        rows = []
        for stem, lines in self.lines().items():
            slot, pid = stem.split(".")
            rows += [{**line, "slot": int(slot[4:]), "pid": int(pid)}
                     for line in lines if "step" in line]
        return rows

    def wait(self, what: str, check: Any, timeout: float) -> Any:
        """Poll the logs until ``check()`` is truthy (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended while waiting for {what}: "
                                   f"{self.launch_log()[-2000:]}")
            time.sleep(0.01)  # polling the members' logs; bounded by the deadline
        raise TimeoutError(f"no {what} within {timeout:.0f}s (a hang?)")

    def live_pid(self, slot: int) -> int:
        """The pid of ``slot``'s newest process."""
        stems = [s for s in self.lines() if s.startswith(f"slot{slot}.")]
        starts = [(self.lines()[s][0]["t"], int(s.split(".")[1])) for s in stems]
        return max(starts)[1]

    def launch_log(self) -> str:
        self.stderr.flush()
        return (self.dir / "launch.err").read_text()

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
            raise

    def digests_agree(self) -> tuple[bool, int]:
        """Whether every member's digest matched at every committed step; steps seen."""
        by_step: dict[int, set[str]] = {}
        for row in self.steps():
            by_step.setdefault(row["step"], set()).add(row["digest"])
        return all(len(d) == 1 for d in by_step.values()), len(by_step)

    def samples_once(self) -> bool:
        """Every sample used exactly once per full data epoch (the final counts)."""
        finals = sorted(self.dir.glob("slot*.final.npz"))
        if not finals:
            return False
        ok = True
        for path in finals:
            with np.load(path) as data:
                used, epoch = data["used"], int(data["data_epoch"])
                cursor, deferred = int(data["cursor"]), int(data["deferred"])
                ok &= bool((used[:epoch] == 1).all())
                ok &= int(used[epoch].sum()) == cursor - deferred
                ok &= not used[epoch + 1:].any()
        return ok

    def restarted_slots(self) -> list[int]:
        return sorted(int(line.split("slot ")[1].split(" ")[0])
                      for line in self.launch_log().splitlines() if "restarting it" in line)


def _kill_and_measure(run: Run, slot: int, ranks: int) -> dict[str, Any]:
    pid = run.live_pid(slot)
    before = max(r["step"] for r in run.steps())
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    first = run.wait("a commit after the kill", lambda: min(
        (r for r in run.steps() if r["t"] > killed and r["pid"] != pid),
        key=lambda r: r["t"], default=None), 30)
    replacement = run.wait("the replacement's first step", lambda: next(
        (r for r in run.steps() if r["slot"] == slot and r["pid"] != pid and r["t"] > killed),
        None), 120)
    lines = run.lines()[f"slot{slot}.{replacement['pid']}"]
    start = next(line for line in lines if line.get("event") == "start")
    fetched = next((line for line in lines if line.get("event") == "fetched"), {})
    return {"slot": slot, "commit_after_kill_s": first["t"] - killed,
            "steps_lost": max(0, before + 1 - first["step"]),
            "survivor_resumed": first.get("resumed", 0),
            "replacement_training_after_start_s": replacement["t"] - start["t"],
            "fetched_mb": fetched.get("bytes", 0) / 1e6,
            "fetch_gbps": (fetched.get("bytes", 0) / fetched["seconds"] / 1e9
                           if fetched.get("seconds") else 0.0),
            "donors": fetched.get("donors", 0)}


def failover(args: argparse.Namespace) -> dict[str, Any]:
    run = Run(args.ranks, steps=args.steps, step_seconds=args.step_seconds,
              state_mb=args.state_mb, until_world=args.ranks)
    results = []
    try:
        for victim in (3, 0):
            run.wait("all members training", lambda: len(
                {r["slot"] for r in run.steps() if r["world"] == args.ranks
                 and r["step"] >= max((x["step"] for x in run.steps()), default=0)}
            ) == args.ranks and max(r["step"] for r in run.steps()) >= 3, 120)
            results.append(_kill_and_measure(run, victim, args.ranks))
        code = run.finish(600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    agree, steps = run.digests_agree()
    print(f"elastic failover: {args.ranks} ranks, {args.step_seconds:.1f} s steps, "
          f"{args.state_mb} MiB of extra state, NETDIST_ELASTIC_TIMEOUT=2")
    print("kill     commit after kill  steps lost  resumed  replacement training after start"
          "  fetch (MB, GB/s, donors)")
    for r in results:
        who = f"slot {r['slot']}" + (" (leader)" if r["slot"] == 0 else "")
        print(f"{who:<14} {r['commit_after_kill_s']:>8.2f} s {r['steps_lost']:>10} "
              f"{r['survivor_resumed']:>8} {r['replacement_training_after_start_s']:>22.2f} s"
              f"   {r['fetched_mb']:.0f} MB at {r['fetch_gbps']:.2f} GB/s from "
              f"{r['donors']} donors")
    print(f"launch exit {code}; slots restarted: {run.restarted_slots()}; every member's "
          f"digest equal at every one of {steps} steps: {agree}; samples once per epoch: "
          f"{run.samples_once()}")
    return {"results": results, "digests_agree": agree, "exit": code,
            "restarted": run.restarted_slots()}


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, list[float]] = {"plain": [], "elastic": []}
    for _ in range(args.repeats):
        for mode in ("plain", "elastic"):
            run = Run(args.ranks, steps=args.steps, step_seconds=args.step_seconds,
                      elastic=mode == "elastic")
            code = run.finish(600)
            if code != 0:
                raise RuntimeError(f"{mode} run failed: {run.launch_log()[-2000:]}")
            rows = [r for r in run.steps() if r["step"] > 2 * (256 if mode == "plain" else 1)]
            times[mode] += [r["seconds"] for r in rows]
    plain, elastic = statistics.mean(times["plain"]), statistics.mean(times["elastic"])
    print(f"elastic overhead: {args.ranks} ranks, {args.step_seconds:.1f} s steps, "
          f"{args.repeats} interleaved runs each")
    print(f"plain netdist  {plain * 1e3:9.1f} ms/step  (n={len(times['plain'])})")
    print(f"elastic        {elastic * 1e3:9.1f} ms/step  (n={len(times['elastic'])})  "
          f"{100 * (elastic / plain - 1):+.2f}%")
    return {"plain_s": plain, "elastic_s": elastic}


def chaos(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    run = Run(args.ranks, steps=10**9, step_seconds=args.step_seconds, until_world=0,
              max_restarts=10**6, timeout=3600, failure_timeout=2.0)
    kinds: dict[str, int] = {}
    recoveries = []
    started = time.monotonic()
    try:
        for event in range(args.events):
            run.wait("all members training", lambda: _all_in(run, args.ranks), 120)
            kind = rng.choice(["kill", "kill", "kill-leader", "kill-two", "stop"])
            kinds[kind] = kinds.get(kind, 0) + 1
            slots = {"kill": [rng.randrange(1, args.ranks)], "kill-leader": [0],
                     "kill-two": rng.sample(range(args.ranks), 2),
                     "stop": [rng.randrange(args.ranks)]}[kind]
            pids = [run.live_pid(s) for s in slots]
            hit = time.time()
            if kind == "stop":
                os.kill(pids[0], signal.SIGSTOP)
                run.wait("the others to drop the stopped member", lambda: any(
                    r["t"] > hit and r["world"] == args.ranks - 1 for r in run.steps()), 60)
                os.kill(pids[0], signal.SIGCONT)
            else:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            run.wait("recovery", lambda: _all_in(run, args.ranks, after=hit), 120)
            recoveries.append(time.time() - hit)
            print(f"event {event + 1:3d}/{args.events}: {kind:<11} slots {slots} "
                  f"back to {args.ranks} members in {recoveries[-1]:.1f} s", flush=True)
        run.wait("all members training", lambda: _all_in(run, args.ranks), 120)
        last = max(r["step"] for r in run.steps())
        (run.dir / "stop_at.tmp").write_text(str(last + 40))
        (run.dir / "stop_at.tmp").replace(run.dir / "stop_at")
        code = run.finish(300)
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
            run.proc.wait(60)
    agree, steps = run.digests_agree()
    print(f"chaos: {args.events} events {kinds} in {time.monotonic() - started:.0f} s, "
          f"{steps} committed steps; hangs: 0; every member's digest equal at every step "
          f"boundary: {agree}; samples once per epoch: {run.samples_once()}; launch exit "
          f"{code}; recovery median {statistics.median(recoveries):.1f} s, "
          f"max {max(recoveries):.1f} s")
    return {"events": args.events, "kinds": kinds, "digests_agree": agree, "steps": steps}


def _all_in(run: Run, ranks: int, after: float = 0.0) -> bool:
    rows = [r for r in run.steps() if r["t"] > after]
    if not rows:
        return False
    newest = max(r["epoch"] for r in rows)
    return len({r["slot"] for r in rows if r["epoch"] == newest and r["world"] == ranks}) \
        == ranks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["failover", "overhead", "chaos", "member"])
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.mode == "member":
        return _member(args.plain)
    if args.mode == "chaos" and "--step-seconds" not in sys.argv:
        args.step_seconds = 0.1
    result = {"failover": failover, "overhead": overhead, "chaos": chaos}[args.mode](args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
