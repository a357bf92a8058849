"""Hundreds of ranks on one machine: connect time, connections held, a 1 + 127 parameter server.

Every job is ``netdist launch -n N`` (``netdist.launcher.launch``, real processes on
127.0.0.1). Each rank:

1. joins (``TcpTransport.connect``: rendezvous, plus the full mesh with ``eager``);
2. runs one ring all-reduce of ``--ring-kib`` KiB of float64 written on the transport
   (send right, receive left: the ring schedule and nothing else) and counts the
   connections it holds (``TcpTransport.connected_peers()``);
3. runs ``Group.all_reduce`` on the same size (the library's own path, shared memory
   off: ``NETDIST_SHM=0``) and counts again;
4. runs ``--ps-rounds`` rounds of the sync ``ParameterServer`` (rank 0 serves and
   trains, the N - 1 others are its workers) on ``--ps-kib`` KiB of float32 gradients
   per rank, timing every round, and counts again;
5. a barrier, then leaves. It writes its clock readings and counts to a JSON file.

Between the phases every rank waits for all the others through marker files in a
shared directory (polled on the event loop, so heartbeats go on): no phase's
connections or CPU leak into another's measurement, and the wait opens no connection.

Reported per job (median over ``--repeats``; jobs interleaved so a change in machine
load hits every configuration alike):

- ``connect``: from the moment the last rank started joining until every rank has
  joined (the part that grows with N once all processes are up; with ``eager`` it
  includes the n(n-1)/2 handshakes);
- ``ring``: from the last rank starting the ring all-reduce until every rank has
  finished it (with ``lazy`` that includes connecting to the two neighbours);
- ``window``: from the first rank starting to join until the last one joined (includes
  the CPU-bound start-up of N Python processes on this machine's cores);
- connections per rank after each phase (max and median over ranks);
- parameter-server rounds: the first (connections made on first use) and the median /
  best of the rest, each round's time being its slowest rank's.

The targets of issue 16 are judged on the ``lazy`` rows: connect(128) <= 2 x
connect(64), connections after the ring all-reduce a handful (<= 4), and every PS round
completed on every rank of the 1 + 127 job.

    python benchmarks/scale.py                         # lazy 64 and 128, eager 64
    python benchmarks/scale.py --sizes 64,128 --eager 64,128 --repeats 3 --json scale.json
    python benchmarks/scale.py --sizes 4 --eager 4 --ps-rounds 2    # a quick check
    python benchmarks/scale.py --raw --repeats 3 --eager 64,128     # with the raw floor

``--raw`` adds, interleaved, the same join done with plain sockets by the same number of
processes (no handshake, no msgpack, no event loop): how much of ``connect`` is the
machine waking N processes, whatever library they run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

HANDFUL = 4
"""Connections per rank a ring all-reduce may hold and still be "a handful"."""

POLL_SECONDS = 0.1
"""How often a rank waiting between phases looks for the phase's "go" file."""


# -- ranks ------------------------------------------------------------------------------


async def _all_reached(outdir: str, phase: str, rank: int, n: int, timeout: float) -> None:
    """Wait until all ``n`` ranks have reached ``phase`` (marker files; no network).

    Each rank writes its marker, then counts the markers once: the last to write sees
    all ``n`` and creates ``<phase>.go``, which the others poll for (a cheap ``stat``, so
    waiting ranks take next to no CPU from the ones still working).
    """
    import asyncio

    open(os.path.join(outdir, f"{phase}.{rank}"), "w", encoding="utf-8").close()
    go = os.path.join(outdir, f"{phase}.go")
    if sum(name.startswith(f"{phase}.") for name in os.listdir(outdir)) >= n:
        open(go, "w", encoding="utf-8").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not every rank reached {phase!r} within "
                               f"{timeout:g}s")
        await asyncio.sleep(POLL_SECONDS)  # the event loop runs meanwhile: heartbeats


async def _rank(args: argparse.Namespace) -> None:
    import numpy as np

    from netdist.collectives import Group
    from netdist.config import DistributedConfig
    from netdist.ps import ParameterServer
    from netdist.transport import TcpTransport
    from tests.transport.lazy_worker import ring_all_reduce  # the transport-level ring

    config = DistributedConfig.from_env()
    record: dict[str, Any] = {"rank": config.rank}
    record["join_start"] = time.time()
    transport = await TcpTransport.connect(config)
    try:
        record["joined"] = time.time()
        record["peers_joined"] = len(transport.connected_peers())
        n, rank = transport.world_size, transport.rank
        await _all_reached(args.outdir, "joined", rank, n, args.op_timeout)
        size = int(args.ring_kib * 1024) // 8
        data = np.arange(size, dtype=np.float64) + rank
        record["ring_start"] = time.time()
        await ring_all_reduce(transport, data, tag=1)
        record["ring_done"] = time.time()
        record["ring_correct"] = bool(np.array_equal(
            data, n * np.arange(size, dtype=np.float64) + n * (n - 1) / 2))
        record["peers_ring"] = len(transport.connected_peers())
        await _all_reached(args.outdir, "ring", rank, n, args.op_timeout)

        group = Group(transport, timeout=args.op_timeout)
        data[...] = rank
        started = time.time()
        await group.all_reduce(data)
        record["group_all_reduce_s"] = time.time() - started
        record["group_correct"] = bool(np.all(data == n * (n - 1) / 2))
        record["peers_group"] = len(transport.connected_peers())
        await _all_reached(args.outdir, "group", rank, n, args.op_timeout)

        ps = ParameterServer(transport, timeout=args.op_timeout)
        grads = [np.full(int(args.ps_kib * 1024) // 4, float(rank), np.float32)]
        rounds = []
        average: list[Any] = []
        for _ in range(args.ps_rounds):
            started = time.time()
            average = await ps.reduce_gradients(grads)
            rounds.append(time.time() - started)
        record["ps_rounds"] = rounds
        record["ps_correct"] = bool(np.all(average[0] == np.float32((n - 1) / 2)))
        record["peers_ps"] = len(transport.connected_peers())
        await group.aclose()
        await transport.barrier(timeout=args.op_timeout)
    finally:
        await transport.aclose()
    with open(os.path.join(args.outdir, f"rank_{config.rank:05d}.json"), "w",
              encoding="utf-8") as f:
        json.dump(record, f)


def _raw_rank(args: argparse.Namespace) -> None:
    """The same join without netdist: plain sockets, no handshake, no msgpack.

    Rank 0 listens on the launcher's coordinator port; every other rank connects (until
    it accepts) and sends its rank; once all have, rank 0 sends each the table (about
    as many bytes as netdist's) and every rank records the moment it has it. This is the
    floor that waking N processes on this machine's cores puts under ``connect``.
    """
    import socket

    rank, n = int(os.environ["NETDIST_RANK"]), int(os.environ["NETDIST_WORLD_SIZE"])
    host, port = os.environ["NETDIST_COORDINATOR"].rsplit(":", 1)
    record: dict[str, Any] = {"rank": rank, "join_start": time.time()}
    table = b"x" * (60 * n)
    deadline = time.monotonic() + args.join_timeout
    if rank == 0:
        with socket.create_server((host, int(port)), backlog=n) as server:
            peers = [server.accept()[0] for _ in range(n - 1)]
            for peer in peers:
                peer.recv(8)
            for peer in peers:
                peer.sendall(len(table).to_bytes(4, "little") + table)
            record["joined"] = time.time()
            for peer in peers:
                peer.close()
    else:
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the coordinator's port is not listening yet
        with sock:
            sock.settimeout(args.join_timeout)
            sock.sendall(rank.to_bytes(8, "little"))
            size = int.from_bytes(_read_exactly(sock, 4), "little")
            _read_exactly(sock, size)
            record["joined"] = time.time()
    with open(os.path.join(args.outdir, f"rank_{rank:05d}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)


def _read_exactly(sock: Any, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the coordinator closed the connection")
        data += chunk
    return data


# -- driver -----------------------------------------------------------------------------


def _job(args: argparse.Namespace, mode: str, n: int) -> dict[str, Any]:
    """Launch one job of ``n`` ranks connecting ``mode``; summarise its rank records."""
    from netdist.launcher import launch

    with tempfile.TemporaryDirectory() as outdir:
        cmd = [sys.executable, HERE, "--role", "raw" if mode == "raw" else "rank",
               "--outdir", outdir, "--join-timeout", repr(args.join_timeout),
               "--ring-kib", repr(args.ring_kib), "--ps-kib", repr(args.ps_kib),
               "--ps-rounds", str(args.ps_rounds), "--op-timeout", repr(args.op_timeout)]
        env = {"NETDIST_CONNECT": mode, "NETDIST_SHM": "0",
               "NETDIST_CONNECT_TIMEOUT": repr(args.join_timeout),
               "NETDIST_TIMEOUT": repr(args.op_timeout)}
        started = time.time()
        status = launch(cmd, n, env=env, prefix_output=True, timeout=args.job_timeout)
        wall = time.time() - started
        records = []
        for name in sorted(os.listdir(outdir)):
            if not name.startswith("rank_"):
                continue  # the phase markers
            with open(os.path.join(outdir, name), encoding="utf-8") as f:
                records.append(json.load(f))
    result: dict[str, Any] = {"mode": mode, "n": n, "status": status, "job_s": wall,
                              "ranks_reported": len(records)}
    if status != 0 or len(records) != n:
        return result
    last_start = max(r["join_start"] for r in records)
    if mode == "raw":
        result.update(connect_s=max(r["joined"] for r in records) - last_start,
                      window_s=max(r["joined"] for r in records)
                      - min(r["join_start"] for r in records))
        return result
    result.update(
        connect_s=max(r["joined"] for r in records) - last_start,
        ring_s=max(r["ring_done"] for r in records) - max(r["ring_start"] for r in records),
        window_s=max(r["joined"] for r in records) - min(r["join_start"] for r in records),
        correct=all(r["ring_correct"] and r["group_correct"] and r["ps_correct"]
                    for r in records))
    for phase in ("joined", "ring", "group", "ps"):
        counts = [r[f"peers_{phase}"] for r in records]
        result[f"peers_{phase}"] = {"max": max(counts), "median": statistics.median(counts)}
    per_round = [max(r["ps_rounds"][i] for r in records) for i in range(args.ps_rounds)]
    result["ps"] = {"rounds": per_round,
                    "completed": min(len(r["ps_rounds"]) for r in records)}
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summarise(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [j for j in jobs if "connect_s" in j]
    out: dict[str, Any] = {"runs": len(jobs), "failed": len(jobs) - len(ok)}
    if not ok:
        return out
    if ok[0]["mode"] == "raw":
        out.update(connect_s=_median([j["connect_s"] for j in ok]),
                   window_s=_median([j["window_s"] for j in ok]),
                   per_run_connect_s=[round(j["connect_s"], 3) for j in ok])
        return out
    out.update(connect_s=_median([j["connect_s"] for j in ok]),
               ring_s=_median([j["ring_s"] for j in ok]),
               window_s=_median([j["window_s"] for j in ok]),
               job_s=_median([j["job_s"] for j in ok]),
               correct=all(j["correct"] for j in ok),
               per_run_connect_s=[round(j["connect_s"], 3) for j in ok])
    for phase in ("joined", "ring", "group", "ps"):
        out[f"peers_{phase}"] = {"max": max(j[f"peers_{phase}"]["max"] for j in ok),
                                 "median": _median([j[f"peers_{phase}"]["median"] for j in ok])}
    firsts = [j["ps"]["rounds"][0] for j in ok if j["ps"]["rounds"]]
    rest = [t for j in ok for t in j["ps"]["rounds"][1:]]
    out["ps"] = {"completed": min(j["ps"]["completed"] for j in ok),
                 "first_ms": _median(firsts) * 1e3,
                 "median_ms": _median(rest) * 1e3,
                 "best_ms": min(rest) * 1e3 if rest else float("nan")}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,128",
                        help="world sizes connecting lazily (default 64,128)")
    parser.add_argument("--eager", default="64",
                        help="world sizes also run with connect=eager, the full mesh at "
                             "start-up, as a baseline ('' for none; default 64)")
    parser.add_argument("--raw", action="store_true",
                        help="also run the lazy sizes' join with plain sockets (no netdist) "
                             "as the machine's floor, interleaved")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, interleaved")
    parser.add_argument("--ring-kib", type=float, default=256.0,
                        help="KiB of float64 per rank in the all-reduces (default 256)")
    parser.add_argument("--ps-kib", type=float, default=64.0,
                        help="KiB of float32 gradients per rank in a PS round (default 64)")
    parser.add_argument("--ps-rounds", type=int, default=5)
    parser.add_argument("--op-timeout", type=float, default=300.0,
                        help="NETDIST_TIMEOUT of the ranks, and the bound on each operation")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="NETDIST_CONNECT_TIMEOUT: N Python processes start slowly on "
                             "few cores, and the coordinator waits for all of them")
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="bound per job")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--outdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role == "rank":
        from netdist.cli.loop import run

        run(_rank(args))
        return 0
    if args.role == "raw":
        _raw_rank(args)
        return 0

    if args.ps_rounds < 1:
        parser.error("--ps-rounds must be >= 1")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    eager = [int(x) for x in args.eager.split(",") if x]
    plan = ([("lazy", n) for n in sizes] + [("eager", n) for n in eager]
            + [("raw", n) for n in sizes if args.raw])
    print(f"netdist launch -n N on {os.cpu_count()} CPUs, 127.0.0.1; {args.repeats} "
          f"repeat(s), interleaved: {', '.join(f'{m} {n}' for m, n in plan)}; ring and "
          f"Group all-reduce {args.ring_kib:g} KiB float64, PS {args.ps_kib:g} KiB float32 x "
          f"{args.ps_rounds} rounds", flush=True)
    jobs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in plan}
    for repeat in range(args.repeats):
        for mode, n in plan:
            job = _job(args, mode, n)
            jobs[(mode, n)].append(job)
            shown = (f"connect {job['connect_s']:.2f} s"
                     + (f", ring {job['ring_s']:.2f} s" if "ring_s" in job else "")
                     if "connect_s" in job else f"FAILED (exit {job['status']}, "
                     f"{job['ranks_reported']} of {n} ranks reported)")
            print(f"  run {repeat + 1}: {mode:5} n={n:<4} job {job['job_s']:6.1f} s, {shown}",
                  flush=True)
    results = {f"{mode} {n}": _summarise(jobs[(mode, n)]) for mode, n in plan}

    print("\nmode   ranks  connect s   ring s  window s  job s   connections per rank (max / "
          "median) after: join  ring  Group.all_reduce  PS")
    for (mode, n), key in zip(plan, results):
        r = results[key]
        if "connect_s" not in r:
            print(f"{mode:6} {n:5}  all {r['runs']} runs failed")
            continue
        if mode == "raw":
            print(f"{mode:6} {n:5}  {r['connect_s']:9.2f}  {'-':>7}  {r['window_s']:8.2f}"
                  "      -   plain sockets: the same join without netdist")
            continue
        peers = "  ".join(f"{r[f'peers_{p}']['max']:>3}/{r[f'peers_{p}']['median']:<5g}"
                          for p in ("joined", "ring", "group", "ps"))
        note = "" if r["correct"] else "  RESULT WRONG"
        print(f"{mode:6} {n:5}  {r['connect_s']:9.2f}  {r['ring_s']:7.2f}  {r['window_s']:8.2f}"
              f"  {r['job_s']:5.1f}   {peers}{note}")
    print("\nsync parameter server, rank 0 serves N - 1 workers (slowest rank per round, ms):")
    for (mode, n), key in zip(plan, results):
        r = results[key]
        if "ps" in r:
            ps = r["ps"]
            print(f"  {mode:5} n={n:<4} 1 server + {n - 1:3} workers: rounds completed "
                  f"{ps['completed']}/{args.ps_rounds}; first {ps['first_ms']:8.1f}  "
                  f"then median {ps['median_ms']:8.1f}  best {ps['best_ms']:8.1f}")

    print()
    lazy = {n: results[f"lazy {n}"] for n in sizes}
    status = 0
    pairs = [(a, b) for a in sizes for b in sizes if b == 2 * a]
    for small, large in pairs:
        if "connect_s" in lazy[small] and "connect_s" in lazy[large]:
            ratio = lazy[large]["connect_s"] / lazy[small]["connect_s"]
            raw = (results.get(f"raw {small}", {}), results.get(f"raw {large}", {}))
            floor = (f"; plain sockets on this machine, same runs: "
                     f"{raw[1]['connect_s']:.3f} / {raw[0]['connect_s']:.3f} s = "
                     f"{raw[1]['connect_s'] / raw[0]['connect_s']:.2f}x"
                     if all("connect_s" in r for r in raw) else "")
            print(f"{'PASS' if ratio <= 2.0 else 'MISS'}  connect time, lazy: n={large} / "
                  f"n={small} = {lazy[large]['connect_s']:.3f} / "
                  f"{lazy[small]['connect_s']:.3f} s = {ratio:.2f}x (target <= 2x){floor}")
    for n in sizes:
        r = lazy[n]
        if "peers_ring" in r:
            held = r["peers_ring"]["max"]
            print(f"{'PASS' if held <= HANDFUL else 'MISS'}  connections per rank after a ring "
                  f"all-reduce, lazy n={n}: at most {held} (target <= {HANDFUL})")
        if "ps" in r:
            done = r["ps"]["completed"] == args.ps_rounds and r["correct"]
            print(f"{'PASS' if done else 'MISS'}  sync PS 1 server + {n - 1} workers: "
                  f"{r['ps']['completed']}/{args.ps_rounds} rounds on every rank, median "
                  f"{r['ps']['median_ms']:.1f} ms per round")
        else:
            status = 1
    for key, r in results.items():
        if r.get("failed"):
            status = 1
            print(f"MISS  {key}: {r['failed']} of {r['runs']} runs failed")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"plan": [f"{m} {n}" for m, n in plan], "results": results,
                       "jobs": {f"{m} {n}": j for (m, n), j in jobs.items()}}, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
