"""Real processes for the elastic tests: start members by slot, watch their progress
files, kill them, restart them (as ``netdist launch --elastic`` would)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (bound, then released)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


class ElasticCluster:
    """``n`` first members (slots ``0..n-1``) and room for ``spares`` more slots."""

    def __init__(self, tmp: Path, n: int, *, spares: int = 0, steps: int = 40,
                 env: dict[str, str] | None = None, timeout: float = 60.0,
                 member: str = "tests.elastic._member") -> None:
        self.dir = tmp
        self.n = n
        self.member = [sys.executable, "-m", member]
        self.ports = free_ports(n + spares + 1)
        self.seeds = ",".join(f"127.0.0.1:{p}" for p in self.ports[1:])
        self.token = secrets.token_hex(16)
        self.timeout = timeout
        self.env = {**os.environ, "NETDIST_TOKEN": self.token,
                    "NETDIST_JOB_ID": f"elastic-test-{secrets.token_hex(4)}",
                    "NETDIST_COORDINATOR": f"127.0.0.1:{self.ports[0]}",
                    "NETDIST_WORLD_SIZE": str(n), "NETDIST_ELASTIC": "1",
                    "NETDIST_ELASTIC_SEEDS": self.seeds, "ELASTIC_TEST_DIR": str(tmp),
                    "ELASTIC_TEST_STEPS": str(steps), "NETDIST_TIMEOUT": str(timeout),
                    "NETDIST_ELASTIC_TIMEOUT": "3", "PYTHONPATH": str(ROOT)}
        self.env.update(env or {})
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: dict[int, int] = {}
        self.logs: list[Path] = []

    def start(self, slot: int, **env: str) -> subprocess.Popen[bytes]:
        """Start (or restart) ``slot``; a restart sets NETDIST_RESTART_COUNT."""
        count = self.restarts.get(slot, -1) + 1
        self.restarts[slot] = count
        log = self.dir / f"slot{slot}.{count}.log"
        self.logs.append(log)
        child_env = {**self.env, "NETDIST_ELASTIC_SLOT": str(slot),
                     "NETDIST_RANK": str(min(slot, self.n - 1)),
                     "NETDIST_RESTART_COUNT": str(count), **env}
        with open(log, "wb") as sink:
            proc = subprocess.Popen(self.member, cwd=ROOT, env=child_env, stdout=sink,
                                    stderr=subprocess.STDOUT)
        self.procs[slot] = proc
        return proc

    def start_all(self, **per_slot: dict[str, str]) -> None:
        """Start the first members; ``per_slot["s2"] = {...}`` adds variables to slot 2."""
        for slot in range(self.n):
            self.start(slot, **per_slot.get(f"s{slot}", {}))

    def progress(self, slot: int) -> dict[str, Any] | None:
        """The last committed step ``slot`` recorded (None before its first)."""
        path = self.dir / f"slot{slot}.json"
        try:
            return dict(json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_until(self, what: str, check: Any, timeout: float | None = None) -> Any:
        """Poll ``check()`` (reads progress files) until it returns a truthy value."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            dead = {s: p.returncode for s, p in self.procs.items()
                    if p.poll() not in (None, 0, -signal.SIGKILL)}
            if dead:
                raise AssertionError(f"while waiting for {what}: slots exited {dead}\n"
                                     + self.tail())
            time.sleep(0.02)  # polling files the members write; bounded by the deadline
        raise AssertionError(f"timed out waiting for {what}\n{self.tail()}")

    def wait_step(self, slot: int, step: int) -> dict[str, Any]:
        """Wait until ``slot`` committed ``step`` steps."""
        return self.wait_until(f"slot {slot} at step {step}", lambda: (
            (p := self.progress(slot)) is not None and p["step"] >= step and p))

    def kill(self, slot: int, signum: int = signal.SIGKILL) -> None:
        """Send ``signum`` to ``slot``'s process (SIGKILL: and reap it)."""
        proc = self.procs[slot]
        proc.send_signal(signum)
        if signum == signal.SIGKILL:
            proc.wait(10)

    def wait_all(self, slots: list[int] | None = None, timeout: float | None = None
                 ) -> dict[int, int]:
        """Wait for ``slots`` (default: every process) to exit; their return codes."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        codes = {}
        for slot in (sorted(self.procs) if slots is None else slots):
            try:
                codes[slot] = self.procs[slot].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"slot {slot} did not finish\n{self.tail()}") from None
        return codes

    def final(self, slot: int) -> dict[str, Any]:
        """What ``slot`` saved at the end (w, used, changes, step...)."""
        with np.load(self.dir / f"slot{slot}.final.npz") as data:
            out = {key: data[key] for key in data.files}
        out["changes"] = json.loads(str(out["changes"]))
        return out

    def tail(self, lines: int = 25) -> str:
        """The last lines of every member's log, for failure messages."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- {log.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def close(self) -> None:
        """Kill whatever still runs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
