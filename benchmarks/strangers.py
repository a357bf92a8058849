"""Strangers benchmark: what 10,000 unauthenticated connections cost a rank (issue 12, item 8).

Runs, on 127.0.0.1 only:

* a real 2-rank job (two processes): an all_reduce loop on 1 MiB of float32 for the
  whole attack, a collective checkpoint save once every stranger connection is open,
  then exit;
* an attacker process that opens ``--count`` idle connections to rank 0's peer listener
  in batches of ``--batch`` (no byte is ever sent: a stranger without the token). After
  each batch it waits (bounded) until all but ``--cap`` of the open connections have been
  closed by the rank, closes those, keeps the rest open, and goes on; at the end it waits
  (bounded) for the rank to drop the ones it held.

The orchestrator resets rank 0's peak RSS just before the attack (``/proc/<pid>/clear_refs``)
and reports the extra RSS the attack cost it (``VmHWM`` at the end minus ``VmRSS`` at the
start, plus the highest ``VmRSS`` sampled meanwhile), rank 0's admission counters, and that
the job finished (steps, checkpoint, exit codes). Target: at most 64 MiB extra RSS.

    python benchmarks/strangers.py [--count 10000] [--batch 500] [--cap 64] [--json]

Every wait is bounded (``--max-seconds`` for the whole run); nothing leaves loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
MIB = 1024 * 1024


# -- /proc --------------------------------------------------------------------------------

def proc_status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak_rss(pid: int) -> bool:
    """Reset ``VmHWM`` of ``pid`` to its current RSS (Linux >= 4.0); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def raise_own_fd_limit() -> int:
    """Raise our soft RLIMIT_NOFILE to the hard limit; return the soft limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


# -- a rank -------------------------------------------------------------------------------

_COMMANDS = {"save": 1, "stop": 2}
"""Lines a rank reads on stdin; ranks agree on the next one by an all_reduce(max)."""


async def rank_main(args: argparse.Namespace) -> int:
    """One rank: all_reduce until told to stop, saving a checkpoint when told to."""
    import numpy as np

    from netdist.checkpoint import save
    from netdist.collectives import Group
    from netdist.config import DistributedConfig
    from netdist.transport import TcpTransport

    config = DistributedConfig.from_env()
    if args.max_unauthenticated and hasattr(config, "admission"):
        from netdist.config import AdmissionLimits

        config = config.replace(admission=AdmissionLimits(
            max_unauthenticated=args.max_unauthenticated))
    commands: list[int] = []
    threading.Thread(target=lambda: commands.extend(
        _COMMANDS.get(line.strip(), 0) for line in sys.stdin), daemon=True).start()
    transport = await TcpTransport.connect(config)
    group = Group(transport)
    steps = saves = 0
    try:
        data = np.ones(256 * 1024, np.float32)
        flag = np.zeros(1, np.int64)
        while True:
            flag[0] = commands[0] if commands else 0
            await group.all_reduce(flag, op="max", timeout=60.0)
            if flag[0] and commands and commands[0] == flag[0]:
                commands.pop(0)
            if flag[0] == _COMMANDS["stop"]:
                break
            if flag[0] == _COMMANDS["save"]:
                saves += 1
                state = {"w": np.arange(1024, dtype=np.float32), "steps": np.int64(steps)}
                result = await save(state, args.ckpt, group, step=saves, timeout=60.0)
                print(json.dumps({"saved": str(result.path), "rank": config.rank}), flush=True)
            await group.all_reduce(data, timeout=60.0)
            data.fill(1.0)
            steps += 1
            if steps == 20:
                print(json.dumps({"running": True, "rank": config.rank, "pid": os.getpid(),
                                  "port": transport.listen_address[1]}), flush=True)
        stats = (transport.admission.stats() if hasattr(transport, "admission") else None)
        print(json.dumps({"done": True, "rank": config.rank, "steps": steps, "saves": saves,
                          "admission": None if stats is None else {
                              "peak_pending": stats.peak_pending, "admitted": stats.admitted,
                              "refused_capacity": stats.refused_capacity,
                              "refused_descriptors": stats.refused_descriptors}}),
              flush=True)
        return 0
    finally:
        await group.aclose()
        await transport.aclose()


# -- the attacker -------------------------------------------------------------------------

async def attacker_main(args: argparse.Namespace) -> int:
    """Open ``count`` idle connections in batches; report what the rank did with them.

    Each connection is classified by how long it lived: closed by the rank within
    ``--quick`` seconds ("refused at once"), later ("held, then dropped": the rank's
    handshake deadline, or its exit), or never (still open when the attack ends: a
    connection the kernel completed but the rank never accepted before it exited).
    """
    raise_own_fd_limit()
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + args.max_seconds
    live: dict[socket.socket, tuple[float, asyncio.Future[float]]] = {}
    counts = {"opened": 0, "connect_failed": 0, "refused_at_once": 0, "held_then_dropped": 0,
              "longest_held_s": 0.0}

    def watch(sock: socket.socket) -> asyncio.Future[float]:
        closed: asyncio.Future[float] = loop.create_future()

        def readable() -> None:
            try:
                data = sock.recv(1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data and not closed.done():
                loop.remove_reader(sock.fileno())
                closed.set_result(loop.time())

        loop.add_reader(sock.fileno(), readable)
        return closed

    def retire(sock: socket.socket) -> None:
        opened, closed = live.pop(sock)
        if closed.done():
            lifetime = closed.result() - opened
            key = "refused_at_once" if lifetime <= args.quick else "held_then_dropped"
            counts[key] += 1
            counts["longest_held_s"] = max(counts["longest_held_s"], round(lifetime, 2))
        else:
            loop.remove_reader(sock.fileno())
        sock.close()

    async def connect() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            async with asyncio.timeout(max(0.1, min(10.0, deadline - loop.time()))):
                await loop.sock_connect(sock, ("127.0.0.1", args.port))
        except (OSError, TimeoutError):
            sock.close()
            counts["connect_failed"] += 1
            return
        counts["opened"] += 1
        live[sock] = (loop.time(), watch(sock))

    async def until_open_at_most(limit: int, timeout: float) -> None:
        """Wait (bounded) until at most ``limit`` connections are still open."""
        try:
            async with asyncio.timeout(max(0.0, min(timeout, deadline - loop.time()))):
                while True:
                    waiting = [closed for _, closed in live.values() if not closed.done()]
                    if len(waiting) <= limit:
                        return
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            pass

    batches = 0
    while counts["opened"] + counts["connect_failed"] < args.count and loop.time() < deadline:
        batches += 1
        todo = min(args.batch, args.count - counts["opened"] - counts["connect_failed"])
        await asyncio.gather(*(connect() for _ in range(todo)))
        await until_open_at_most(args.cap, args.batch_wait)
        for sock in [s for s, (_, closed) in live.items() if closed.done()]:
            retire(sock)
    counts["open_after_last_batch"] = len(live)
    print(json.dumps({"opening_done": True, "open": len(live)}), flush=True)
    await until_open_at_most(0, args.hold_wait)  # the rank drops what it held
    counts["never_closed"] = sum(1 for _, closed in live.values() if not closed.done())
    for sock in list(live):
        retire(sock)
    counts["batches"] = batches
    counts["seconds"] = round(loop.time() - started, 2)
    print(json.dumps(counts), flush=True)
    return 0


# -- the orchestrator ---------------------------------------------------------------------

class Child:
    """A child process whose stdout lines (JSON) are read by a thread, with bounded waits."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE), *argv], env=env, cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            if not is_stdout:
                self.stderr.append(line)
                continue
            try:
                item = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.lines.append(item)
                self._cond.notify_all()

    def wait_for(self, key: str, timeout: float) -> dict[str, Any]:
        """The first stdout JSON object with ``key``; RuntimeError after ``timeout``."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self.lines:
                    if key in item:
                        return item
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self._has(key):
                    raise RuntimeError(f"child {self.proc.args[2:4]} gave no {key!r}: "
                                       f"{''.join(self.stderr[-20:])}")
                self._cond.wait(min(left, 0.5))

    def _has(self, key: str) -> bool:
        return any(key in item for item in self.lines)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return -9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    ckpt = tempfile.mkdtemp(prefix="netdist-strangers-")
    base_env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                    NETDIST_WORLD_SIZE="2", NETDIST_COORDINATOR=f"127.0.0.1:{free_port()}",
                    NETDIST_TOKEN=secrets.token_hex(16),
                    NETDIST_JOB_ID=f"strangers-{secrets.token_hex(4)}")
    rank_args = ["--role", "rank", "--ckpt", ckpt,
                 "--max-unauthenticated", str(args.max_unauthenticated)]
    ranks = [Child(rank_args, dict(base_env, NETDIST_RANK=str(r))) for r in range(2)]
    attacker: Child | None = None
    try:
        running = ranks[0].wait_for("running", 120)
        ranks[1].wait_for("running", 120)
        pid, port = running["pid"], running["port"]
        rss_before = proc_status_kib(pid, "VmRSS")
        hwm_reset = reset_peak_rss(pid)
        rss_samples = [rss_before]
        attacker = Child(["--role", "attacker", "--port", str(port), "--count",
                          str(args.count), "--batch", str(args.batch), "--cap", str(args.cap),
                          "--batch-wait", str(args.batch_wait), "--quick", str(args.quick),
                          "--hold-wait", str(args.hold_wait),
                          "--max-seconds", str(args.max_seconds)], dict(os.environ))
        started = time.monotonic()
        while not attacker._has("opening_done"):
            if attacker.proc.poll() is not None or time.monotonic() - started > args.max_seconds:
                break
            rss_samples.append(proc_status_kib(pid, "VmRSS"))
            time.sleep(0.05)  # sampling interval of the RSS probe, not synchronisation
        attacker.wait_for("opening_done", 30)
        for rank in ranks:  # a checkpoint save while the held strangers are connected
            rank.send("save")
        saved = [rank.wait_for("saved", 120) for rank in ranks]
        # the job keeps running while the rank drops the strangers it held
        while not attacker._has("seconds"):
            if attacker.proc.poll() is not None or time.monotonic() - started > (
                    args.max_seconds + args.hold_wait):
                break
            rss_samples.append(proc_status_kib(pid, "VmRSS"))
            time.sleep(0.05)  # sampling interval of the RSS probe, not synchronisation
        report = attacker.wait_for("seconds", 60)
        rss_samples.append(proc_status_kib(pid, "VmRSS"))
        hwm = proc_status_kib(pid, "VmHWM") if hwm_reset else max(rss_samples)
        for rank in ranks:
            rank.send("stop")
        done = [rank.wait_for("done", 120) for rank in ranks]
        codes = [rank.finish(60) for rank in ranks] + [attacker.finish(60)]
        return {
            "count": args.count, "batch": args.batch, "attacker": report,
            "rss_before_mib": rss_before / 1024, "peak_rss_mib": hwm / 1024,
            "peak_source": "VmHWM" if hwm_reset else "VmRSS samples",
            "max_sampled_rss_mib": max(rss_samples) / 1024,
            "extra_rss_mib": (max(hwm, max(rss_samples)) - rss_before) / 1024,
            "admission": done[0]["admission"], "steps": [d["steps"] for d in done],
            "checkpoint": saved[0]["saved"], "exit_codes": codes,
            "job_finished": all(code == 0 for code in codes),
        }
    finally:
        for child in [*ranks, *([attacker] if attacker else [])]:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait(10)


def print_report(result: dict[str, Any], target_mib: float) -> None:
    attack = result["attacker"]
    admission = result["admission"]
    print(f"strangers: {result['count']} idle connections to rank 0 of a 2-rank job, in "
          f"batches of {result['batch']} (127.0.0.1)")
    print(f"  attacker  opened {attack['opened']} in {attack['batches']} batches, "
          f"{attack['seconds']} s: closed by the rank at once {attack['refused_at_once']}, "
          f"held then dropped {attack['held_then_dropped']} (longest "
          f"{attack['longest_held_s']} s), open after the last batch "
          f"{attack['open_after_last_batch']}, never closed {attack['never_closed']}, "
          f"connect failures {attack['connect_failed']}")
    print(f"  rank 0    RSS before {result['rss_before_mib']:.1f} MiB, peak "
          f"{result['peak_rss_mib']:.1f} MiB ({result['peak_source']}), extra "
          f"{result['extra_rss_mib']:.1f} MiB (target <= {target_mib:g} MiB: "
          f"{'met' if result['extra_rss_mib'] <= target_mib else 'MISSED'})")
    if admission is not None:
        print(f"  admission peak pending {admission['peak_pending']}, admitted "
              f"{admission['admitted']}, refused {admission['refused_capacity']} (cap) + "
              f"{admission['refused_descriptors']} (descriptors)")
    print(f"  job       {result['steps'][0]} all_reduce steps during the attack, checkpoint "
          f"{Path(result['checkpoint']).name} saved with the strangers connected, exit codes "
          f"{result['exit_codes']}: "
          f"{'finished' if result['job_finished'] else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="stranger connections")
    parser.add_argument("--batch", type=int, default=100, help="connections per batch")
    parser.add_argument("--cap", type=int, default=64,
                        help="connections the attacker expects the rank to hold (its wait)")
    parser.add_argument("--max-unauthenticated", type=int, default=0,
                        help="the ranks' AdmissionLimits.max_unauthenticated (0: default)")
    parser.add_argument("--batch-wait", type=float, default=5.0,
                        help="seconds a batch waits for the rank to close connections")
    parser.add_argument("--quick", type=float, default=1.0,
                        help="a connection closed within this many seconds was refused")
    parser.add_argument("--hold-wait", type=float, default=20.0,
                        help="seconds to wait for the rank to drop the ones it held")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the attack")
    parser.add_argument("--target-mib", type=float, default=64.0, help="extra RSS allowed")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--role", choices=["orchestrator", "rank", "attacker"],
                        default="orchestrator", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.count < 1 or args.batch < 1 or args.cap < 0:
        parser.error("--count and --batch must be >= 1, --cap >= 0")
    if args.role == "rank":
        return asyncio.run(rank_main(args))
    if args.role == "attacker":
        return asyncio.run(attacker_main(args))
    result = orchestrate(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result, args.target_mib)
    return 0 if result["job_finished"] and result["extra_rss_mib"] <= args.target_mib else 1


if __name__ == "__main__":
    sys.exit(main())
