"""Does one TCP connection keep a long link full? Socket buffers against striping.

A TCP connection moves at most one window per round trip: ``rate <= window / RTT``, the
window bounded by the receiver's buffer (``SO_RCVBUF``) and the sender's
(``SO_SNDBUF``). netdist's peer sockets used to set both to 4 MiB, which caps each at
twice ``net.core.{r,w}mem_max`` and turns off the kernel's receive autotuning (which
would otherwise grow the receive buffer up to ``net.ipv4.tcp_rmem[2]``). This script
measures, on two network namespaces joined by a delaying link (``netdist.netlab``'s TUN
forwarder, the kernel here having no ``netem``), shaped to a known rate with ``tc tbf``:

- ``capacity``: the forwarder with no delay and no shaping (what the model can carry);
- for each one-way delay, interleaved round by round, ONE connection moving ``--size-mib``
  with (a) ``netdist``: the options ``tune_socket`` sets (called at run time, so the
  column follows the library), (a') ``both``: ``SO_SNDBUF`` and ``SO_RCVBUF`` at
  ``SOCKET_BUFFER_BYTES`` (what netdist set before issue 29), (b) ``autotune``: neither
  option, (c) ``sndbuf``: ``SO_SNDBUF`` only (the receive buffer autotuned), (c')
  ``big``: both options at the largest value a socket may ask for (``rmem_max`` /
  ``wmem_max``, read from /proc); (d) ``stripe``: ``--streams`` connections in parallel,
  each with ``tune_socket``'s options; and (e) ``transport``: netdist's own
  ``Transport.send`` of the same bytes (in 8 messages) between two ranks
  (``netdist.init()`` with ``NETDIST_*`` set per rank).

Each row prints the rate over the whole transfer (first byte to last, at the receiver),
the steady rate (over the second half of the bytes: slow start excluded), the link rate,
and the window bound ``min(sender's window, receiver's advertised window) / RTT`` with the
windows read back from the sockets: ``SO_SNDBUF`` (the kernel's doubled value, which
also pays for bookkeeping), ``SO_RCVBUF`` at the end of the transfer (autotuning grows it),
the largest window the receiver advertised (``tcp_info.tcpi_snd_wnd`` on the sender) and
the connection's smallest RTT (``tcpi_min_rtt``), and the share of the sender's busy time
it was limited by the receiver's window (``rwnd``) or its own send buffer (``sndbuf``).

The delays make a scaled model: at ``--rate-mbit`` R and round trip T the
bandwidth-delay product R*T is that of real links with the same product (1-10 Gbit/s
at 0.1-50 ms: 12.5 KB to 62.5 MB); a window-bound connection reaches the same fraction of
its link at the same BDP whatever the rate. The table header names the real pairs.

    sudo python benchmarks/link_fill.py [--delays-ms 25,50,100,200] [--rate-mbit 400]
        [--size-mib 64] [--streams 4] [--rounds 2] [--default-host]
        [--ns-sysctl KEY=VALUE] [--json PATH] [--quick]

Needs root and ``netdist.netlab`` (``netlab_missing()``); every process and socket wait
is bounded (``--transfer-timeout``), and the lab is deleted at the end, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1024 * 1024
PORT = 29600
CHUNK = MIB
RAW_VARIANTS = ("netdist", "both", "autotune", "sndbuf", "big")
"""The single-connection variants (see the module docstring)."""
REAL_RATES_GBIT = (1.0, 10.0)
DEFAULT_MEM_MAX = 212992
"""``net.core.rmem_max`` / ``wmem_max`` as Linux ships them."""
DEFAULT_TCP_RMEM = "4096 131072 6291456"
DEFAULT_TCP_WMEM = "4096 16384 4194304"
"""``net.ipv4.tcp_rmem`` / ``tcp_wmem`` as Linux ships them (on a machine with a few GiB
of memory or more)."""

# struct tcp_info (linux/tcp.h) offsets
_TCP_INFO_BYTES = 240
_U32_MIN_RTT = 148
_U64_BUSY = 168
_U64_RWND_LIMITED = 176
_U64_SNDBUF_LIMITED = 184
_U64_BYTES_RETRANS = 208
_U32_SND_WND = 228


# -- socket options per variant ---------------------------------------------------------

def apply_variant(sock: socket.socket, variant: str) -> None:
    """Set ``variant``'s options on ``sock`` (TCP_NODELAY always, as netdist does).

    ``LINK_FILL_CAP`` (bytes), when set, clamps every explicit request as
    ``net.core.{r,w}mem_max`` would on a host where they are that small."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    from netdist.transport.connection import SOCKET_BUFFER_BYTES, read_sysctl, tune_socket

    cap = int(os.environ.get("LINK_FILL_CAP", "0")) or None

    def ask(option: int, value: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, option, min(value, cap or value))

    if variant in ("netdist", "stripe"):
        tune_socket(sock)
    elif variant == "both":
        ask(socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        ask(socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    elif variant == "sndbuf":
        ask(socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    elif variant == "big":
        for option, path in ((socket.SO_SNDBUF, "/proc/sys/net/core/wmem_max"),
                             (socket.SO_RCVBUF, "/proc/sys/net/core/rmem_max")):
            ask(option, read_sysctl(path) or 4 * MIB)
    elif variant != "autotune":
        raise ValueError(f"unknown variant {variant!r}")


@dataclass(slots=True)
class Window:
    """What the sender's kernel said about one connection."""

    sndbuf: int = 0
    rcvbuf: int = 0
    snd_wnd_max: int = 0
    min_rtt_s: float = 0.0
    rwnd_share: float = 0.0
    sndbuf_share: float = 0.0
    retrans_bytes: int = 0


def _tcp_info(sock: socket.socket) -> bytes:
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return b""


def _u32(raw: bytes, offset: int) -> int:
    return struct.unpack_from("<I", raw, offset)[0] if len(raw) >= offset + 4 else 0


def _u64(raw: bytes, offset: int) -> int:
    return struct.unpack_from("<Q", raw, offset)[0] if len(raw) >= offset + 8 else 0


# -- worker: the receiving end ----------------------------------------------------------

def _drain(conn: socket.socket, deadline: float, marks: list[tuple[float, int]],
           lock: threading.Lock, rcvbufs: list[int]) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with conn:
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            n = conn.recv_into(view)
            if n == 0:
                break
            with lock:
                marks.append((time.perf_counter(), n))
        rcvbufs.append(conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def rates(marks: list[tuple[float, int]]) -> tuple[int, float, float]:
    """Bytes, the rate over all of them (from the end of the first read) and the rate
    over the second half of them, in bytes per second, from receive marks."""
    marks = sorted(marks)
    total = sum(n for _, n in marks)
    if len(marks) < 2:
        return total, 0.0, 0.0
    start, end = marks[0][0], marks[-1][0]
    whole = (total - marks[0][1]) / (end - start) if end > start else 0.0
    seen, half_at, half_bytes = 0, start, 0
    for when, n in marks:
        seen += n
        if seen >= total / 2:
            half_at, half_bytes = when, total - seen
            break
    tail = half_bytes / (end - half_at) if end > half_at else 0.0
    return total, whole, tail


def receive(address: str, port: int, variant: str, streams: int, seconds: float) -> None:
    """Listen (the variant's options on the listening socket: accepted ones inherit them,
    as in ``netdist.transport.connection.start_listener``), take ``streams``
    connections, read each to its end; print one JSON line."""
    deadline = time.monotonic() + seconds
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        apply_variant(server, variant)
        server.bind((address, port))
        server.listen(streams)
        print("READY", flush=True)
        marks: list[tuple[float, int]] = []
        rcvbufs: list[int] = []
        lock = threading.Lock()
        threads = []
        for _ in range(streams):
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            conn, _ = server.accept()
            threads.append(threading.Thread(target=_drain,
                                            args=(conn, deadline, marks, lock, rcvbufs)))
            threads[-1].start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.001))
    total, whole, tail = rates(marks)
    print(json.dumps({"bytes": total, "rate": whole, "tail": tail, "rcvbuf": max(rcvbufs)}),
          flush=True)


# -- worker: the sending end ------------------------------------------------------------

def _send_one(address: str, port: int, variant: str, size: int, deadline: float,
              windows: list[Window]) -> None:
    block = b"\x5a" * CHUNK
    with socket.create_connection((address, port),
                                  timeout=max(deadline - time.monotonic(), 0.001)) as conn:
        apply_variant(conn, variant)  # after connect, as FrameConnection.connection_made
        window = Window(sndbuf=conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        stop = threading.Event()

        def watch() -> None:  # samples the advertised window while the bytes flow
            while not stop.wait(0.01):
                window.snd_wnd_max = max(window.snd_wnd_max, _u32(_tcp_info(conn), _U32_SND_WND))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        left = size
        while left:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.sendall(block[:min(left, CHUNK)])
            left -= min(left, CHUNK)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        if conn.recv(1) != b"":
            raise RuntimeError("the receiver sent data")
        stop.set()
        watcher.join(1.0)
        window.sndbuf = max(window.sndbuf, conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        raw = _tcp_info(conn)
        busy = _u64(raw, _U64_BUSY) or 1
        window.min_rtt_s = _u32(raw, _U32_MIN_RTT) / 1e6
        window.rwnd_share = _u64(raw, _U64_RWND_LIMITED) / busy
        window.sndbuf_share = _u64(raw, _U64_SNDBUF_LIMITED) / busy
        window.retrans_bytes = _u64(raw, _U64_BYTES_RETRANS)
        window.snd_wnd_max = max(window.snd_wnd_max, _u32(raw, _U32_SND_WND))
        windows.append(window)


def send(address: str, port: int, variant: str, streams: int, size: int,
         seconds: float) -> None:
    """Send ``size`` bytes over ``streams`` connections (split evenly), half-close each
    and wait for the receiver to close it; print one JSON line of the windows seen."""
    deadline = time.monotonic() + seconds
    windows: list[Window] = []
    shares = [size // streams + (1 if i < size % streams else 0) for i in range(streams)]
    threads = [threading.Thread(target=_send_one,
                                args=(address, port, variant, share, deadline, windows))
               for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.001))
    if len(windows) != streams:
        raise SystemExit(f"only {len(windows)} of {streams} connections finished")
    print(json.dumps([asdict(w) for w in windows]), flush=True)


# -- worker: netdist's Transport between two ranks --------------------------------------

async def _transport_rank(size: int, pieces: int, seconds: float) -> None:
    import numpy as np

    import netdist

    piece = size // pieces
    async with netdist.init() as transport:
        peer = 1 - transport.rank
        go = np.zeros(1, np.uint8)
        await transport.barrier(timeout=seconds)
        if transport.rank == 0:
            message = np.full(piece, 0x5A, np.uint8)
            await transport.send(peer, go, tag=1, timeout=seconds)
            for _ in range(pieces):
                await transport.send(peer, message, tag=2, timeout=seconds)
            await transport.recv(peer, tag=3, out=go, timeout=seconds)
            print(json.dumps(socket_memory()), flush=True)
        else:
            landing = np.empty(piece, np.uint8)
            await transport.recv(peer, tag=1, out=go, timeout=seconds)
            marks = [(time.perf_counter(), 1)]
            for _ in range(pieces):
                await transport.recv(peer, tag=2, out=landing, timeout=seconds)
                marks.append((time.perf_counter(), piece))
            await transport.send(peer, go, tag=3, timeout=seconds)
            total, whole, tail = rates(marks)
            print(json.dumps({"bytes": total - 1, "rate": whole, "tail": tail,
                              **socket_memory()}), flush=True)


def socket_memory() -> dict[str, int]:
    """The largest receive and send buffers (``rb``/``tb`` of ``ss -m``: what
    ``SO_RCVBUF``/``SO_SNDBUF`` read back) among this namespace's TCP connections to
    ``LINK_FILL_PEER``: the Transport's sockets, read without touching its internals."""
    peer = os.environ.get("LINK_FILL_PEER", "")
    try:
        listing = subprocess.run(["ss", "-tmnH", "dst", peer], capture_output=True,
                                 text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    found = {"rcvbuf": 0, "sndbuf": 0}
    for key, name in (("rb", "rcvbuf"), ("tb", "sndbuf")):
        for match in re.finditer(rf"[(,]{key}(\d+)", listing):
            found[name] = max(found[name], int(match.group(1)))
    return found


# -- the orchestration ------------------------------------------------------------------

@dataclass(slots=True)
class Row:
    """One measured transfer."""

    delay_ms: float
    variant: str
    streams: int
    round: int
    seconds: float
    rate_mbit: float
    tail_mbit: float
    sndbuf: int = 0
    rcvbuf: int = 0
    snd_wnd_max: int = 0
    min_rtt_ms: float = 0.0
    bound_mbit: float | None = None
    rwnd_share: float | None = None
    sndbuf_share: float | None = None
    retrans_bytes: int = 0
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _worker_argv(*args: object) -> list[str]:
    return [sys.executable, HERE, "_worker", *(str(a) for a in args)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NETDIST_", "MASTER_"))}
    env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **extra)
    return env


def _json_line(text: str) -> Any:
    for line in reversed(text.splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise RuntimeError(f"no result line in {text!r}")


def raw_transfer(lab: Any, link: Any, variant: str, streams: int, size: int,
                 timeout: float, port: int) -> dict[str, Any]:
    """One transfer from ``link.a`` to ``link.b``; the receiver's and sender's reports."""
    receiver = lab.popen(link.b, _worker_argv("receive", link.address_b, port, variant,
                                              streams, timeout),
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = receiver.stdout.readline()  # bounded: the worker prints or exits
        if ready.strip() != "READY":
            raise RuntimeError(f"receiver did not start: {ready!r} {receiver.stderr.read()}")
        sender = lab.popen(link.a, _worker_argv("send", link.address_b, port, variant,
                                                streams, size, timeout),
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
        try:
            sent_out, sent_err = sender.communicate(timeout=timeout + 10)
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.communicate()
        got_out, got_err = receiver.communicate(timeout=timeout + 10)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.communicate()
    if sender.returncode or receiver.returncode:
        raise RuntimeError(f"sender {sender.returncode}: {sent_err.strip()[-400:]}; "
                           f"receiver {receiver.returncode}: {got_err.strip()[-400:]}")
    return {"received": _json_line(got_out), "windows": _json_line(sent_out)}


def transport_transfer(lab: Any, link: Any, size: int, timeout: float,
                       port: int) -> dict[str, Any]:
    """``Transport.send`` of ``size`` bytes (in 8 messages) from rank 0 on ``link.a`` to
    rank 1 on ``link.b``; both ranks' reports."""
    from netdist.netlab.processes import start_rank, wait_all

    token = secrets.token_hex(16)
    ranks = []
    for rank, (host, own, other) in enumerate(((link.a, link.address_a, link.address_b),
                                               (link.b, link.address_b, link.address_a))):
        env = _env(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE="2",
                   NETDIST_COORDINATOR=f"{link.address_a}:{port}",
                   NETDIST_ADVERTISE_ADDR=own, NETDIST_LISTEN_HOST=own, NETDIST_TOKEN=token,
                   NETDIST_HOST_ID=host.name, LINK_FILL_PEER=other)
        ranks.append(start_rank(rank, host.name, _worker_argv("transport", size, 8, timeout),
                                env, cwd=REPO))
    results = wait_all(ranks, timeout + 20)
    for result in results:
        if not result.ok:
            raise RuntimeError(f"rank {result.rank} exit {result.returncode} "
                               f"killed={result.killed}: {result.stderr.strip()[-600:]}")
    return {"sent": _json_line(results[0].stdout), "received": _json_line(results[1].stdout)}


def measure(lab: Any, link: Any, delay_ms: float, variant: str, streams: int, size: int,
            timeout: float, round_: int, port: int, link_mbit: float | None) -> Row:
    """One row: a transfer of ``variant`` over ``link``; a failed one has ``error`` set."""
    started = time.perf_counter()
    try:
        if variant == "transport":
            report = transport_transfer(lab, link, size, timeout, port)
            windows = [{"sndbuf": report["sent"]["sndbuf"]}]
        else:
            report = raw_transfer(lab, link, variant, streams, size, timeout, port)
            windows = report["windows"]
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        return Row(delay_ms, variant, streams, round_, time.perf_counter() - started, 0.0,
                   0.0, error=str(exc)[-300:])
    got = report["received"]
    if got["bytes"] != size:
        return Row(delay_ms, variant, streams, round_, 0.0, 0.0, 0.0,
                   error=f"received {got['bytes']} of {size} bytes")
    row = Row(delay_ms, variant, streams, round_,
              seconds=size / got["rate"] if got["rate"] else 0.0,
              rate_mbit=got["rate"] * 8 / 1e6, tail_mbit=got["tail"] * 8 / 1e6,
              sndbuf=max(w["sndbuf"] for w in windows), rcvbuf=got["rcvbuf"])
    if variant != "transport":
        row.snd_wnd_max = max(w["snd_wnd_max"] for w in windows)
        row.min_rtt_ms = min(w["min_rtt_s"] for w in windows) * 1e3
        row.rwnd_share = max(w["rwnd_share"] for w in windows)
        row.sndbuf_share = max(w["sndbuf_share"] for w in windows)
        row.retrans_bytes = sum(w["retrans_bytes"] for w in windows)
        if row.min_rtt_ms > 0:
            per_stream = [min(w["sndbuf"], w["snd_wnd_max"]) * 8 / w["min_rtt_s"] / 1e6
                          for w in windows if w["min_rtt_s"] > 0]
            row.bound_mbit = sum(per_stream)
    return row


def real_pairs(bdp_bytes: float) -> str:
    """The real (rate, RTT) pairs with this bandwidth-delay product."""
    return ", ".join(f"{rate:g} Gbit/s x {bdp_bytes * 8 / (rate * 1e9) * 1e3:.3g} ms"
                     for rate in REAL_RATES_GBIT)


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: Row, link_mbit: float | None) -> None:
    if row.error:
        print(f"{row.delay_ms:>6g} {row.variant:<10} {row.streams:>2} {row.round:>2}  "
              f"FAILED: {row.error}", flush=True)
        return
    share = f"{row.rate_mbit / link_mbit:5.0%}" if link_mbit else "    -"
    print(f"{row.delay_ms:>6g} {row.variant:<10} {row.streams:>2} {row.round:>2} "
          f"{row.rate_mbit:>8.0f} {row.tail_mbit:>8.0f} {share} {_fmt(link_mbit):>6} "
          f"{_fmt(row.bound_mbit):>7} {row.sndbuf / MIB:>6.1f} {row.rcvbuf / MIB:>6.1f} "
          f"{row.snd_wnd_max / MIB:>6.1f} {row.min_rtt_ms:>6.1f} "
          f"{_fmt(row.rwnd_share, '.0%'):>5} {_fmt(row.sndbuf_share, '.0%'):>6} "
          f"{row.retrans_bytes / MIB:>6.1f}", flush=True)


HEADER = (f"{'delay':>6} {'variant':<10} {'K':>2} {'r':>2} {'Mbit/s':>8} {'steady':>8} "
          f"{'link%':>5} {'link':>6} {'win/RTT':>7} {'sndbuf':>6} {'rcvbuf':>6} "
          f"{'advwin':>6} {'RTT':>6} {'rwnd':>5} {'sndlim':>6} {'retx':>6}\n"
          f"{'ms':>6} {'':<10} {'':>2} {'':>2} {'(whole)':>8} {'(2nd½)':>8} {'':>5} "
          f"{'Mbit/s':>6} {'Mbit/s':>7} {'MiB':>6} {'MiB':>6} {'MiB':>6} {'ms':>6} "
          f"{'':>5} {'':>6} {'MiB':>6}")


def shape_link(lab: Any, link: Any, rate_mbit: float) -> None:
    """Limit both TUN devices' egress (into the forwarder) to ``rate_mbit``; the tbf
    queue holds up to 100 ms of traffic at that rate."""
    for host, device in ((link.a, link.devices[0]), (link.b, link.devices[1])):
        lab.shape(host, device, rate_mbit)


def set_mtu(lab: Any, link: Any, mtu: int) -> None:
    for host, device in ((link.a, link.devices[0]), (link.b, link.devices[1])):
        lab.exec(host, "ip", "link", "set", "dev", device, "mtu", str(mtu))


def sysctls() -> dict[str, str]:
    names = ("net/ipv4/tcp_rmem", "net/ipv4/tcp_wmem", "net/core/rmem_max",
             "net/core/wmem_max", "net/ipv4/tcp_congestion_control")
    out = {}
    for name in names:
        try:
            with open(f"/proc/sys/{name}") as handle:
                out[name.replace("/", ".")] = " ".join(handle.read().split())
        except OSError:
            out[name.replace("/", ".")] = "?"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays-ms", default="25,50,100,200",
                        help="one-way delays of the link, comma-separated")
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="the link's rate (tc tbf on both TUN devices); 0: unshaped")
    parser.add_argument("--mtu", type=int, default=9000,
                        help="the TUN devices' MTU (larger: fewer packets per byte for "
                             "the Python forwarder)")
    parser.add_argument("--size-mib", type=float, default=64.0)
    parser.add_argument("--streams", type=int, default=4, help="K for the striped variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join((*RAW_VARIANTS, "stripe", "transport")))
    parser.add_argument("--transfer-timeout", type=float, default=60.0,
                        help="seconds any one transfer may take")
    parser.add_argument("--default-host", action="store_true",
                        help="model a host with the kernel's default buffer sysctls: "
                             "tcp_rmem/tcp_wmem set to the defaults in the lab's namespaces, "
                             "explicit requests clamped to 212992 bytes (rmem_max/wmem_max); "
                             "runs both, autotune and sndbuf only")
    parser.add_argument("--ns-sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a per-namespace sysctl for both hosts (e.g. "
                             "net.ipv4.tcp_wmem='4096 16384 67108864'), the machine's left "
                             "alone; repeatable")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--quick", action="store_true",
                        help="one 25 ms delay, 4 MiB, K=2, one round: that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.delays_ms, args.size_mib, args.streams, args.rounds = "25", 4.0, 2, 1
        args.transfer_timeout = min(args.transfer_timeout, 30.0)

    from netdist.netlab import NetLab, netlab_missing

    missing = netlab_missing()
    if missing is not None:
        print(f"link_fill needs netlab: {missing}", file=sys.stderr)
        return 2
    delays = [float(d) for d in args.delays_ms.split(",") if d.strip()]
    variants = [v for v in args.variants.split(",") if v]
    if args.default_host:
        variants = [v for v in variants if v in ("both", "autotune", "sndbuf")]
        os.environ["LINK_FILL_CAP"] = str(DEFAULT_MEM_MAX)
    size = int(args.size_mib * MIB)
    link_mbit = args.rate_mbit or None
    rows: list[Row] = []
    print("sysctls (this namespace): "
          + "; ".join(f"{k} = {v}" for k, v in sysctls().items()))
    from netdist.transport.connection import SOCKET_BUFFER_BYTES

    print(f"netdist: SOCKET_BUFFER_BYTES = {SOCKET_BUFFER_BYTES / MIB:g} MiB; TUN mtu "
          f"{args.mtu}; {args.size_mib:g} MiB per transfer; striping K={args.streams}")
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        for setting in args.ns_sysctl:
            for host in (a, b):
                lab.exec(host, "sysctl", "-q", setting)
            print(f"in the namespaces: {setting}")
        if args.default_host:
            for host in (a, b):
                lab.exec(host, "sysctl", "-q", f"net.ipv4.tcp_rmem={DEFAULT_TCP_RMEM}",
                         f"net.ipv4.tcp_wmem={DEFAULT_TCP_WMEM}")
            print(f"default host: in the namespaces net.ipv4.tcp_rmem = {DEFAULT_TCP_RMEM}, "
                  f"net.ipv4.tcp_wmem = {DEFAULT_TCP_WMEM}; requests clamped to "
                  f"{DEFAULT_MEM_MAX} (net.core.rmem_max/wmem_max)")
        capacity_link = lab.lossy_link(a, b, loss=0.0, delay=0.0)
        set_mtu(lab, capacity_link, args.mtu)
        links = {}
        for delay in delays:
            link = lab.lossy_link(a, b, loss=0.0, delay=delay / 1e3)
            set_mtu(lab, link, args.mtu)
            if link_mbit:
                shape_link(lab, link, link_mbit)
            links[delay] = link
        print("\ncapacity of the forwarder (delay 0, unshaped), one connection each:")
        print(HEADER)
        capacity = []
        for variant in ("autotune", "both"):
            row = measure(lab, capacity_link, 0.0, variant, 1, size, args.transfer_timeout, 0,
                          PORT, None)
            rows.append(row)
            capacity.append(row.rate_mbit)
            print_row(row, None)
        print("\nmodelled links (BDP = link rate x RTT, RTT = 2 x delay):")
        for delay in delays:
            if link_mbit:
                bdp = link_mbit * 1e6 / 8 * 2 * delay / 1e3
                print(f"  delay {delay:g} ms: BDP {bdp / MIB:.2f} MiB = {real_pairs(bdp)}")
        print()
        print(HEADER)
        port = PORT + 1
        for round_ in range(args.rounds):
            for delay in delays:
                for variant in variants:
                    streams = args.streams if variant == "stripe" else 1
                    row = measure(lab, links[delay], delay, variant, streams, size,
                                  args.transfer_timeout, round_, port, link_mbit)
                    port += 1
                    rows.append(row)
                    print_row(row, link_mbit)
    summary = summarize(rows, delays, variants)
    print("\nmedian steady rate (Mbit/s) per delay and variant"
          + (f", link {link_mbit:g} Mbit/s" if link_mbit else "") + ":")
    print(f"{'delay':>6} " + " ".join(f"{v:>10}" for v in variants))
    for delay in delays:
        print(f"{delay:>6g} " + " ".join(f"{_fmt(summary.get((delay, v))):>10}"
                                          for v in variants))
    failed = [r for r in rows if r.error]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"quick": args.quick, "rate_mbit": link_mbit, "mtu": args.mtu,
                       "size": size, "sysctls": sysctls(), "capacity_mbit": capacity,
                       "rows": [asdict(r) for r in rows],
                       "failed": [asdict(r) for r in failed]}, handle, indent=1)
    return 1 if failed else 0


def summarize(rows: list[Row], delays: list[float],
              variants: list[str]) -> dict[tuple[float, str], float]:
    """The median steady rate of each (delay, variant) over the rounds that succeeded."""
    out = {}
    for delay in delays:
        for variant in variants:
            got = [r.tail_mbit for r in rows
                   if r.delay_ms == delay and r.variant == variant and not r.error]
            if got:
                out[(delay, variant)] = statistics.median(got)
    return out


def worker(args: list[str]) -> None:
    mode, *rest = args
    if mode == "receive":
        receive(rest[0], int(rest[1]), rest[2], int(rest[3]), float(rest[4]))
    elif mode == "send":
        send(rest[0], int(rest[1]), rest[2], int(rest[3]), int(rest[4]), float(rest[5]))
    elif mode == "transport":
        asyncio.run(_transport_rank(int(rest[0]), int(rest[1]), float(rest[2])))
    else:
        raise SystemExit(f"unknown worker mode {mode!r}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
