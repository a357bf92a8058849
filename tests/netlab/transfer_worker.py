"""TCP endpoints for the cluster tests, run in a host of a ``netdist.netlab`` cluster.

``serve ADDR PORT PEERS``: listen, print ``READY``, take ``PEERS`` connections and read
each to its end (all at once, one thread each), then print ``RECEIVED BYTES SECONDS``:
every byte and the time from the first connection to the last end.

``send PORT SIZE ADDR...``: send ``SIZE`` bytes to each ``ADDR`` at once, half-close,
and wait for the receiver to close (so every byte has crossed the link), then print
``SENT BYTES SECONDS`` (from the first connect to the last close).

``probe ADDR PORT SECONDS``: one connection attempt bounded by ``SECONDS``; prints
``CONNECTED SECONDS`` or ``FAILED SECONDS ERROR``.

Every socket wait is bounded by ``TIMEOUT``.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

TIMEOUT = 120.0
CHUNK = 1 << 20


def _drain(conn: socket.socket, counts: list[int]) -> None:
    with conn:
        conn.settimeout(TIMEOUT)
        while data := conn.recv(CHUNK):
            counts.append(len(data))


def serve(address: str, port: int, peers: int) -> None:
    with socket.create_server((address, port)) as server:
        server.settimeout(TIMEOUT)
        print("READY", flush=True)
        counts: list[int] = []
        threads = []
        started = 0.0
        for i in range(peers):
            conn, _ = server.accept()
            if i == 0:
                started = time.perf_counter()
            threads.append(threading.Thread(target=_drain, args=(conn, counts)))
            threads[-1].start()
        for thread in threads:
            thread.join(TIMEOUT)
        print(f"RECEIVED {sum(counts)} {time.perf_counter() - started:.4f}", flush=True)


def _send(address: str, port: int, size: int, sent: list[int]) -> None:
    with socket.create_connection((address, port), timeout=TIMEOUT) as conn:
        block = b"\x5a" * min(size, CHUNK)
        left = size
        while left:
            conn.sendall(block[:left])
            left -= min(left, len(block))
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b"", "the receiver sent data"
        sent.append(size)


def send(port: int, size: int, addresses: list[str]) -> None:
    sent: list[int] = []
    started = time.perf_counter()
    threads = [threading.Thread(target=_send, args=(a, port, size, sent)) for a in addresses]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    print(f"SENT {sum(sent)} {time.perf_counter() - started:.4f}", flush=True)


def probe(address: str, port: int, seconds: float) -> None:
    started = time.perf_counter()
    try:
        socket.create_connection((address, port), timeout=seconds).close()
    except OSError as exc:
        print(f"FAILED {time.perf_counter() - started:.4f} {exc!r}", flush=True)
        return
    print(f"CONNECTED {time.perf_counter() - started:.4f}", flush=True)


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "serve":
        serve(args[0], int(args[1]), int(args[2]))
    elif mode == "send":
        send(int(args[0]), int(args[1]), args[2:])
    elif mode == "probe":
        probe(args[0], int(args[1]), float(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
