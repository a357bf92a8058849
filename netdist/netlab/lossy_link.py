"""A link that loses and delays packets, for kernels without ``netem``.

Run as a program by ``netdist.netlab.NetLab.lossy_link`` (as root)::

    python -m netdist.netlab.lossy_link NS_A DEV_A NS_B DEV_B --loss 0.3 --delay 0.05 --seed 7

It opens a TUN device in each of two network namespaces (``setns`` on this one thread,
then back), prints ``READY`` and forwards every IP packet read from one device to the
other: each one is dropped with probability ``loss`` (independently, both directions),
the others are written ``delay`` seconds after they were read, in order. The caller
gives the devices their addresses; the devices vanish when this process exits (they are
not persistent), so a killed forwarder leaves nothing behind. It stops on SIGTERM, on
end of standard input, or after ``--max-seconds`` (bounded, like every loop that sends
in the tests).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tun(namespace: str, device: str) -> int:
    """A TUN device named ``device`` created in network namespace ``namespace``."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            ifr = struct.pack("16sH", device.encode(), _IFF_TUN | _IFF_NO_PI)
            fcntl.ioctl(fd, _TUNSETIFF, ifr)
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)
    os.set_blocking(fd, False)
    return fd


def forward(fds: tuple[int, int], loss: float, delay: float, rng: random.Random,
            max_seconds: float) -> None:
    """Move packets between the two devices until stopped (see the module docstring)."""
    stop_at = time.monotonic() + max_seconds
    due: list[tuple[float, int, int, bytes]] = []  # (when, order, destination, packet)
    order = 0
    other = {fds[0]: fds[1], fds[1]: fds[0]}
    watched = [fds[0], fds[1], sys.stdin.fileno()]
    while True:
        now = time.monotonic()
        if now >= stop_at:
            return
        while due and due[0][0] <= now:
            _, _, dst, packet = heapq.heappop(due)
            try:
                os.write(dst, packet)
            except OSError:
                pass  # the device went down: the packet is lost, as on a real link
        wait = min(stop_at - now, 1.0) if not due else max(due[0][0] - now, 0.0)
        ready, _, _ = select.select(watched, [], [], wait)
        for fd in ready:
            if fd == sys.stdin.fileno():
                if not os.read(fd, 4096):
                    return  # our parent went away
                continue
            for _ in range(256):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if rng.random() < loss:
                    continue
                order += 1
                heapq.heappush(due, (time.monotonic() + delay, order, other[fd], packet))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ns_a")
    parser.add_argument("dev_a")
    parser.add_argument("ns_b")
    parser.add_argument("dev_b")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    args = parser.parse_args()
    if not 0.0 <= args.loss < 1.0 or args.delay < 0:
        parser.error("--loss must be in [0, 1) and --delay >= 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fds = (open_tun(args.ns_a, args.dev_a), open_tun(args.ns_b, args.dev_b))
    print("READY", flush=True)
    forward(fds, args.loss, args.delay, random.Random(args.seed), args.max_seconds)


if __name__ == "__main__":
    main()
