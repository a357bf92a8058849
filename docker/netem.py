#!/usr/bin/env python3
"""netdist-netem: ``NETDIST_NETEM`` on kernels built without the netem qdisc.

``tc qdisc ... netem`` needs ``CONFIG_NET_SCH_NETEM``; some kernels (this CI machine's
among them) lack it, and ``tc`` says "Specified qdisc kind is unknown". Then the
entrypoint runs ``netdist-netem apply --dev eth0 ARGS`` with the same netem arguments,
and this emulates the two that matter for training traffic with what such kernels have:

- ``rate R``: a ``tbf`` qdisc at rate R on the device (burst: 1 ms worth of R, at
  least 4 KiB; big GSO packets are segmented by tbf itself);
- ``delay D``: every *incoming* packet goes to an NFQUEUE queue
  (``iptables-legacy -t mangle -A PREROUTING -i DEV -j NFQUEUE --queue-bypass``) and a
  small daemon (``netdist-netem serve``, standard library only, speaking netfilter's
  netlink protocol) releases each packet D after it was queued, in order. Packets are
  never copied to user space (metadata only); one batch verdict releases all packets
  that are due; a full queue fails open rather than dropping.

  Why incoming: a packet held on the sender's side stays charged to its socket, and TCP
  Small Queues then allow only a couple of packets in flight (2 Mbit/s at 20 ms); netem
  avoids this by orphaning packets, which user space cannot do. A packet crossing the
  bridge is already orphaned. With every container shaped (the compose cluster), each
  packet is delayed exactly once either way, so round trips see 2 D as with netem; a
  single shaped container sees D per round trip, as with netem on its egress alone.

Anything else (jitter, loss, reorder, ...) is refused with a clear error rather than
silently ignored. The daemon is started in the background, and the iptables rule is only
added once it is bound, so no packet ever waits for nobody.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NLMSG_DONE = 3


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(msg: int, queue: int, attrs: bytes, *, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    offset = 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            break
        out[kind & 0x7FFF] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return out


class DelayQueue:
    """One bound NFQUEUE queue and the packets it holds."""

    def __init__(self, queue: int, delay: float) -> None:
        self.queue = queue
        self.delay = delay
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self.seq = 0
        self.pending: collections.deque[tuple[float, int]] = collections.deque()

    def _request(self, msg: int, attrs: bytes) -> None:
        """Send a config request and wait for its acknowledgement (raise on error)."""
        self.seq += 1
        self.sock.send(_message(msg, self.queue, attrs, seq=self.seq,
                                flags=NLM_F_REQUEST | NLM_F_ACK))
        while True:
            data = self.sock.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", data, offset)
                if length < 16:
                    break
                if kind == NLMSG_ERROR and seq == self.seq:
                    (error,) = struct.unpack_from("=i", data, offset + 16)
                    if error:
                        raise OSError(-error, f"nfqueue config: {os.strerror(-error)}")
                    return
                offset += (length + 3) & ~3

    def bind(self) -> None:
        """Bind the queue (metadata only, GSO packets whole, fail open when full); bounded:
        a kernel that does not answer within 5 s raises ``TimeoutError``."""
        self.sock.settimeout(5.0)
        self._request(NFQNL_MSG_CONFIG, _attr(NFQA_CFG_CMD, struct.pack(
            "!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)))
        self._request(NFQNL_MSG_CONFIG,
                      _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                      + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536))
                      + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))
                      + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)))
        self.sock.settimeout(None)

    def _receive(self) -> None:
        """Record the arrival of every packet notification waiting on the socket."""
        now = time.monotonic()
        while True:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # notifications lost; a later batch
                    continue                    # verdict still releases those packets
                raise
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, offset)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    attrs = _attrs(data[offset + 20:offset + length])
                    header = attrs.get(NFQA_PACKET_HDR)
                    if header is not None:
                        (packet_id,) = struct.unpack_from("!I", header)
                        self.pending.append((now + self.delay, packet_id))
                offset += (length + 3) & ~3

    def _release_due(self) -> None:
        now = time.monotonic()
        last = None
        while self.pending and self.pending[0][0] <= now:
            last = self.pending.popleft()[1]
        if last is not None:
            self.seq += 1
            self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue,
                                    _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last)),
                                    seq=self.seq))

    def run(self, stop: list[bool]) -> None:
        while not stop:
            timeout = None
            if self.pending:
                timeout = max(0.0, self.pending[0][0] - time.monotonic())
            try:
                readable, _, _ = select.select([self.sock], [], [], timeout)
            except InterruptedError:
                continue
            if readable:
                self._receive()
            self._release_due()


_UNITS_TIME = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}
_UNITS_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def _number_with_unit(text: str, units: dict[str, float], what: str) -> float:
    lowered = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit):
            number = lowered[: -len(unit)]
            try:
                return float(number) * units[unit]
            except ValueError:
                break
    raise ValueError(f"cannot parse {what} {text!r} (e.g. {'10ms' if what == 'delay' else '100mbit'})")


def parse_netem(args: list[str]) -> tuple[float, float | None]:
    """``(delay seconds, rate bits/s or None)`` from netem arguments; ValueError otherwise."""
    delay, rate = 0.0, None
    i = 0
    while i < len(args):
        key = args[i]
        if key in ("delay", "rate") and i + 1 < len(args):
            if key == "delay":
                delay = _number_with_unit(args[i + 1], _UNITS_TIME, "delay")
                if i + 2 < len(args) and args[i + 2][:1].isdigit():
                    raise ValueError("delay jitter needs the netem qdisc, which this kernel lacks")
            else:
                rate = _number_with_unit(args[i + 1], _UNITS_RATE, "rate")
            i += 2
            continue
        raise ValueError(f"netem option {key!r} needs the netem qdisc, which this kernel "
                         "lacks (only 'delay D' and 'rate R' are emulated)")
    if delay < 0 or (rate is not None and rate <= 0):
        raise ValueError("delay must be >= 0 and rate > 0")
    return delay, rate


def _run(cmd: list[str]) -> None:
    import subprocess

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")


def apply(dev: str, netem_args: list[str], queue: int, ready_timeout: float = 10.0) -> None:
    """Shape ``dev``'s egress as ``netem_args`` would; start the delay daemon if needed."""
    import subprocess

    delay, rate = parse_netem(netem_args)
    if rate is not None:
        burst = max(4096, int(rate / 8 * 1e-3))
        _run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
              "burst", str(burst), "latency", "200ms"])
    if delay > 0:
        ready = f"/run/netdist-netem-{queue}.ready"
        try:
            os.unlink(ready)
        except FileNotFoundError:
            pass
        daemon = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", "--queue", str(queue),
             "--delay-ms", repr(delay * 1e3), "--ready-file", ready],
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while not os.path.exists(ready):
            if daemon.poll() is not None:
                raise OSError(f"the delay daemon exited with code {daemon.returncode}")
            if time.monotonic() > deadline:
                daemon.kill()
                raise OSError(f"the delay daemon did not bind NFQUEUE {queue} "
                              f"within {ready_timeout:g} s")
            time.sleep(0.01)  # polling a local file a daemon creates; bounded above
        _run(["iptables-legacy", "-t", "mangle", "-A", "PREROUTING", "-i", dev, "-j",
              "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netdist-netem",
                                     description="netem 'delay' and 'rate' without the netem qdisc")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("apply", help="shape a device's egress (starts the delay daemon)")
    p.add_argument("--dev", default="eth0")
    p.add_argument("--queue", type=int, default=0, help="NFQUEUE number (default 0)")
    p.add_argument("netem", nargs=argparse.REMAINDER, help="netem arguments: delay D, rate R")
    p = commands.add_parser("serve", help="the delay daemon (started by apply)")
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--ready-file", default=None, help="created once the queue is bound")
    args = parser.parse_args(argv)

    if args.command == "apply":
        netem = [a for a in args.netem if a != "--"]
        try:
            apply(args.dev, netem, args.queue)
        except (ValueError, OSError) as exc:
            print(f"netdist-netem: {exc}", file=sys.stderr)
            return 1
        return 0

    if not args.delay_ms >= 0:
        parser.error(f"--delay-ms must be >= 0, got {args.delay_ms}")
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    queue = DelayQueue(args.queue, args.delay_ms / 1000.0)
    try:
        queue.bind()
    except OSError as exc:
        print(f"netdist-netem: cannot bind NFQUEUE {args.queue}: {exc}", file=sys.stderr)
        return 1
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    queue.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
