"""netdist collectives against torch.distributed's Gloo backend, side by side, one run.

For each world size, the same collectives and sizes run first through Gloo (when torch
is installed; it is never a netdist dependency) and then through netdist's ``Group``
over ``TcpTransport``, each rank a separate process on 127.0.0.1 started by
``netdist.launcher.launch``. Timing is identical for both: a barrier, then one call, per
iteration; an iteration's time is the slowest rank's; the median over iterations is
reported, and the whole measurement is repeated ``--repeats`` times (median of medians,
because other processes share the cores). busbw uses nccl-tests' factors. The raw
loopback ceilings are measured in the same run: blocking sockets moving 64 MiB messages
one way and both ways at once, and, per world size, a ring of raw sockets with every link
busy (for n = 2 the both-ways figure: one connection used in both directions, as
netdist's ring does). A ring collective's busbw is the bytes each rank sends per second,
so it is quoted as a fraction of that ring ceiling, next to the fraction the 1.5x / 2x
Gloo targets of issue 3 would need.

    python benchmarks/compare_gloo.py                      # defaults below
    python benchmarks/compare_gloo.py --world-sizes 2,4 --ops all_reduce \\
        --sizes 8,1M,16M,64M,256M --iters 10 --repeats 3 --json out.json

``--mpi`` adds Open MPI in the same run, interleaved with the other two: the collectives
of ``mpi_collectives.c`` (built with ``mpicc``, run with ``mpirun`` on this host, so MPI
moves bytes through its shared-memory transport), timed the same way; the issue-16
targets name Open MPI's figures. Needs ``apt-get install openmpi-bin libopenmpi-dev``.

Every child is bounded by ``--child-timeout``; loopback only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def _factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "broadcast": 1.0}.get(op, 0.0)


def _parse_sizes(text: str) -> list[int]:
    from netdist.collectives.benchmark import parse_sizes

    return parse_sizes(text)


# -- Gloo worker ------------------------------------------------------------------------

def _gloo_worker(spec: dict[str, Any]) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host, port = os.environ["NETDIST_COORDINATOR"].rsplit(":", 1)
    rank, n = int(os.environ["NETDIST_RANK"]), int(os.environ["NETDIST_WORLD_SIZE"])
    # torch's TCPStore listens on the launcher's free coordinator port (netdist is not
    # running in these processes)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=n)
    results = []
    for op in spec["ops"]:
        for size in ([0] if op == "barrier" else spec["sizes"]):
            count = max(1, size // 4)
            if op in ("reduce_scatter", "all_gather"):
                count = max(n, count - count % n)
            full = torch.zeros(count, dtype=torch.float32)
            part = torch.zeros(count // n, dtype=torch.float32)

            def call() -> None:
                if op == "all_reduce":
                    dist.all_reduce(full)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(part, full)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(full, part)
                elif op == "broadcast":
                    dist.broadcast(full, 0)
                else:
                    dist.barrier()

            try:
                times = _time_iterations(call, dist.barrier, spec["iters"], spec["warmup"])
            except (RuntimeError, NotImplementedError) as exc:  # op unsupported by Gloo
                results.append({"op": op, "size": count * 4, "error": str(exc)[:120]})
                continue
            worst = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results.append({"op": op, "size": 0 if op == "barrier" else count * 4,
                            "median_s": float(np.median(worst.numpy()))})
    if rank == 0:
        with open(spec["out"], "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _time_iterations(call: Any, barrier: Any, iters: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + iters):
        barrier()
        started = time.perf_counter()
        call()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    return times


# -- netdist worker ---------------------------------------------------------------------

def _netdist_worker(spec: dict[str, Any]) -> None:
    from netdist.cli.loop import run
    from netdist.collectives import Group
    from netdist.collectives.benchmark import run_benchmark
    from netdist.transport.bootstrap import init

    async def main() -> None:
        async with init() as transport:
            group = Group(transport)
            results = []
            async with group:
                for op in spec["ops"]:
                    rows = await run_benchmark(group, op, spec["sizes"], iters=spec["iters"],
                                               warmup=spec["warmup"], check=spec["check"])
                    results.extend({"op": r.op, "size": r.size,
                                    "median_s": r.time_median_us / 1e6, "check": r.check}
                                   for r in rows)
            if transport.rank == 0:
                with open(spec["out"], "w", encoding="utf-8") as fh:
                    json.dump(results, fh)

    run(main())


# -- raw loopback ceiling ---------------------------------------------------------------

def _raw_ceiling(size: int = 64 * 1024 * 1024, count: int = 8,
                 both_ways: bool = False) -> float:
    """Blocking-socket throughput (GB/s, per direction) between two processes.

    One way: a sender ``sendall``s 64 MiB messages, a receiver ``recv_into``s them. Both
    ways: each process sends (in a thread) while it receives, the data movement of an
    n=2 ring all-reduce (each rank sends and receives ``N``), so busbw can be compared.
    """
    import threading

    def receive(conn: socket.socket, view: memoryview) -> None:
        got = 0
        while got < size:
            got += conn.recv_into(view[got:])

    def exchange(conn: socket.socket, payload: bytes, view: memoryview) -> None:
        sender = None
        if both_ways:
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
        receive(conn, view)
        if sender is not None:
            sender.join()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # child: the other end
        try:
            listener.close()
            sock = socket.create_connection(("127.0.0.1", port), timeout=120)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = bytes(size)
            view = memoryview(bytearray(size))
            for _ in range(count + 2):
                if both_ways:
                    exchange(sock, payload, view)
                else:
                    sock.sendall(payload)
                sock.recv(1)
        finally:
            os._exit(0)
    conn, _ = listener.accept()
    conn.settimeout(120)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(size)
    view = memoryview(bytearray(size))
    times = []
    for i in range(count + 2):
        started = time.perf_counter()
        exchange(conn, payload, view)
        if i >= 2:
            times.append(time.perf_counter() - started)
        conn.sendall(b"k")
    os.waitpid(pid, 0)
    conn.close()
    listener.close()
    return size / statistics.median(times) / 1e9


def _raw_ring_ceiling(n: int, size: int = 64 * 1024 * 1024, count: int = 6,
                      warmup: int = 2, with_cpu: bool = False) -> Any:
    """Raw socket throughput (GB/s) per link of an ``n``-process ring, all links busy.

    Every process streams ``size``-byte messages to the next while it receives from the
    previous, from and into real (touched) memory, in one thread with non-blocking sockets
    and ``select`` (no framing, no event loop): the data movement of every step of a ring
    collective, at the least user-space cost. A ring collective's busbw is the bytes each
    rank sends divided by its time, so this figure is what such a collective can reach on
    this host; every byte costs two kernel copies on shared cores, so an algorithm that
    sends the bandwidth-optimal bytes any other way is bound alike. Measured by rank 0 over
    ``count`` messages after ``warmup``. ``with_cpu``: return ``(rate, kernel seconds per
    GB sent + received)``, both from rank 0.
    """
    import resource
    import selectors

    import numpy as np

    listeners = []
    for _ in range(n):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listeners.append(listener)
    ports = [listener.getsockname()[1] for listener in listeners]
    chunk = 4 * 1024 * 1024

    def rank_main(rank: int) -> tuple[float, float]:
        for other, listener in enumerate(listeners):
            if other != rank:
                listener.close()
        out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % n]), timeout=120)
        inc, _ = listeners[rank].accept()
        listeners[rank].close()
        for sock in (out, inc):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        payload = memoryview(np.ones(size, np.uint8))
        view = memoryview(np.zeros(size, np.uint8))
        total = (warmup + count) * size
        sent = received = 0
        started = finished = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        deadline = started + 300
        with selectors.DefaultSelector() as selector:
            selector.register(out, selectors.EVENT_WRITE)
            selector.register(inc, selectors.EVENT_READ)
            while (received < total or sent < total) and time.perf_counter() < deadline:
                for key, _ in selector.select(timeout=1.0):
                    if key.fileobj is out:
                        at = sent % size
                        try:
                            sent += out.send(payload[at:min(size, at + chunk)])
                        except BlockingIOError:
                            pass
                        if sent >= total:
                            selector.unregister(out)
                    else:
                        at = received % size
                        try:
                            got = inc.recv_into(view[at:min(size, at + chunk)])
                        except BlockingIOError:
                            continue
                        if got == 0:
                            raise ConnectionError("ring neighbour closed early")
                        if received + got >= total:
                            finished = time.perf_counter()
                            kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                            selector.unregister(inc)
                        if received < warmup * size <= received + got:
                            started = time.perf_counter()  # warm-up done
                            usage = resource.getrusage(resource.RUSAGE_SELF)
                        received += got
        if received < total:
            raise TimeoutError(f"raw ring rank {rank}: {received} of {total} bytes in 300 s")
        out.close()
        inc.close()
        return (count * size / (finished - started) / 1e9,
                (kernel - usage.ru_stime) / (2 * count * size / 1e9))

    children = []
    for rank in range(1, n):
        pid = os.fork()
        if pid == 0:  # child: one ring member
            try:
                rank_main(rank)
            finally:
                os._exit(0)
        children.append(pid)
    try:
        rate, kernel_per_gb = rank_main(0)
    finally:
        for pid in children:
            os.waitpid(pid, 0)
    return (rate, kernel_per_gb) if with_cpu else rate


SPEEDUP_TARGETS = {"all_reduce": 1.5, "reduce_scatter": 2.0, "all_gather": 2.0}
"""busbw targets relative to Gloo (issue 3); these ops' busbw is the bytes each rank
sends per second, so the ring ceiling bounds them."""


# -- orchestration ----------------------------------------------------------------------

def _run_backend(backend: str, n: int, spec: dict[str, Any], timeout: float) -> list[dict]:
    from netdist.launcher import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "rows.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        code = launch([sys.executable, HERE, "--worker", backend, spec_path], n,
                      timeout=timeout, env={"PYTHONPATH": REPO})
        if code != 0 or not os.path.exists(spec["out"]):
            print(f"# {backend} n={n}: workers failed (exit {code})", file=sys.stderr)
            return []
        with open(spec["out"], encoding="utf-8") as fh:
            return json.load(fh)


def _build_mpi(tmp: str) -> str:
    """Compile ``mpi_collectives.c`` into ``tmp``; the path of the program."""
    import shutil
    import subprocess

    if shutil.which("mpicc") is None or shutil.which("mpirun") is None:
        sys.exit("--mpi needs mpicc and mpirun (apt-get install openmpi-bin libopenmpi-dev)")
    program = os.path.join(tmp, "mpi_collectives")
    subprocess.run(["mpicc", "-O2", "-o", program,
                    os.path.join(os.path.dirname(HERE), "mpi_collectives.c")], check=True)
    return program


def _run_mpi(program: str, n: int, spec: dict[str, Any], timeout: float) -> list[dict]:
    """One Open MPI run of ``spec``'s ops and sizes on ``n`` local ranks."""
    import subprocess

    pairs = [str(x) for op in spec["ops"] if op != "barrier"
             for size in spec["sizes"] for x in (op, size)]
    command = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n),
               program, str(spec["iters"]), str(spec["warmup"]), *pairs]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        print(f"# mpi n={n}: timed out after {timeout:.0f}s", file=sys.stderr)
        return []
    if done.returncode != 0:
        print(f"# mpi n={n}: exit {done.returncode}: {done.stderr.strip()[-400:]}",
              file=sys.stderr)
        return []
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _median_rows(runs: list[list[dict]]) -> dict[tuple[str, int], dict[str, Any]]:
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for rows in runs:
        for row in rows:
            key = (row["op"], row["size"])
            entry = merged.setdefault(key, {"times": [], "checks": set(), "error": None})
            if "median_s" in row:
                entry["times"].append(row["median_s"])
            if "check" in row:
                entry["checks"].add(row["check"])
            if "error" in row:
                entry["error"] = row["error"]
    for entry in merged.values():
        entry["median_s"] = statistics.median(entry["times"]) if entry["times"] else None
    return merged


def _mpi_columns(t_mpi: float | None, t_nd: float | None, size: int, factor: float,
                 shown: bool) -> str:
    """The ``mpi busbw`` and ``vs mpi`` (netdist's busbw over MPI's) columns."""
    if not shown:
        return ""
    bw_mpi = size / t_mpi / 1e9 * factor if t_mpi and size else None
    ratio = t_mpi / t_nd if t_mpi and t_nd else None
    return (f"  {'-' if bw_mpi is None else f'{bw_mpi:.3f}':>10} "
            f"{'-' if ratio is None else f'{ratio:.2f}x':>7}")


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default="8,1M,16M,64M,256M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="independent runs per backend; medians are reported")
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--mpi", action="store_true",
                        help="also time Open MPI's collectives, interleaved (mpicc, mpirun)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        backend, spec_path = args.worker
        with open(spec_path, encoding="utf-8") as fh:
            spec = json.load(fh)
        (_gloo_worker if backend == "gloo" else _netdist_worker)(spec)
        return 0

    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = set(ops) - set(OPS)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}")
    sizes = _parse_sizes(args.sizes)
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        print("# torch is not installed: Gloo columns are skipped "
              "(pip install torch to compare)", flush=True)
    ceiling = _raw_ceiling()
    ceiling2 = _raw_ceiling(both_ways=True)
    print(f"# raw loopback ceiling, blocking sockets, 64 MiB messages: one way "
          f"{ceiling:.2f} GB/s; both ways at once {ceiling2:.2f} GB/s per direction",
          flush=True)
    spec = {"ops": ops, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
            "check": args.check}
    report: list[dict[str, Any]] = []
    mpi_dir = tempfile.TemporaryDirectory() if args.mpi else None
    mpi_program = _build_mpi(mpi_dir.name) if mpi_dir is not None else None
    for n in (int(x) for x in args.world_sizes.split(",")):
        gloo_runs, nd_runs, mpi_runs = [], [], []
        for _ in range(args.repeats):  # interleave so all see the same background load
            if have_torch:
                gloo_runs.append(_run_backend("gloo", n, spec, args.child_timeout))
            nd_runs.append(_run_backend("netdist", n, spec, args.child_timeout))
            if mpi_program is not None:
                mpi_runs.append(_run_mpi(mpi_program, n, spec, args.child_timeout))
        gloo = _median_rows(gloo_runs)
        nd = _median_rows(nd_runs)
        mpi = _median_rows(mpi_runs)
        # n=2: a ring's two links are one connection used both ways (acks ride on data)
        ring = ceiling2 if n == 2 else _raw_ring_ceiling(n)
        print(f"\n# world size {n}: median of {args.repeats} runs x {args.iters} iterations")
        print(f"# raw ring ceiling, {n} processes, every link busy at once "
              f"({'the both-ways figure' if n == 2 else 'non-blocking sockets, select'}): "
              f"{ring:.2f} GB/s per link, the busbw of the data movement alone")
        print(f"# {'op':<15}{'size':>8} {'gloo time':>11} {'netdist time':>13} "
              f"{'gloo busbw':>11} {'netdist busbw':>14} {'speedup':>8}  check"
              + (f"  {'mpi busbw':>10} {'vs mpi':>7}" if mpi_program else ""))
        for key in sorted(nd, key=lambda k: (ops.index(k[0]), k[1])):
            op, size = key
            t_nd = nd[key]["median_s"]
            g = gloo.get(key, {})
            t_g = g.get("median_s")
            factor = _factor(op, n)
            bw_nd = size / t_nd / 1e9 * factor if t_nd and size else None
            bw_g = size / t_g / 1e9 * factor if t_g and size else None
            speedup = t_g / t_nd if t_g and t_nd else None
            check = ",".join(sorted(nd[key]["checks"])) or "-"
            from netdist.collectives.benchmark import format_size
            print(f"  {op:<15}{format_size(size):>8} "
                  f"{(_fmt_time(t_g) if not g.get('error') else 'unsupported'):>11} "
                  f"{_fmt_time(t_nd):>13} "
                  f"{'-' if bw_g is None else f'{bw_g:.3f}':>11} "
                  f"{'-' if bw_nd is None else f'{bw_nd:.3f}':>14} "
                  f"{'-' if speedup is None else f'{speedup:.2f}x':>8}  {check}"
                  + _mpi_columns(mpi.get(key, {}).get("median_s"), t_nd, size, factor,
                                 bool(mpi_program)))
            entry = {"world_size": n, "op": op, "size": size, "gloo_s": t_g,
                     "netdist_s": t_nd, "gloo_busbw": bw_g, "netdist_busbw": bw_nd,
                     "speedup": speedup, "check": check,
                     "mpi_s": mpi.get(key, {}).get("median_s")}
            report.append(entry)
            entry["ring_ceiling_gbps"] = ring
            if op in SPEEDUP_TARGETS and bw_nd and size >= 16 * 1024 * 1024:
                factor_target = SPEEDUP_TARGETS[op]
                need = "" if bw_g is None else (
                    f"; {factor_target:g}x Gloo would be {factor_target * bw_g / ring:.0%} "
                    "of it")
                print(f"  {'':<23}netdist busbw = {bw_nd / ring:.0%} of the ring ceiling"
                      f"{need}" + (f"; {bw_nd / ceiling:.0%} of the one-way ceiling"
                                   if n == 2 else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"ceiling_one_way_gbps": ceiling, "ceiling_both_ways_gbps": ceiling2,
                       "rows": report}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
