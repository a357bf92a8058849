"""Start the ranks of a job as local processes and keep them together.

``launch()`` is what ``netdist launch`` runs, usable as a library too (it imports nothing
from the CLI). It starts ``nprocs`` children, each in its own process group, with the
environment ``netdist.init()`` reads::

    NETDIST_RANK, NETDIST_WORLD_SIZE   this child's rank, the number of children
    NETDIST_COORDINATOR                host:port of rank 0's coordinator (a free port on
                                       127.0.0.1 unless one is given; new on each restart)
    NETDIST_JOB_ID                     shared by every rank and every restart
    NETDIST_TOKEN                      shared secret for the handshake; taken from the
                                       environment, else generated (never printed)
    NETDIST_RESTART_COUNT              0 on the first start, k on the k-th restart
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   for torch-style code
    MASTER_ADDR, MASTER_PORT           for torch.distributed: the coordinator's host and
                                       another free port (unless already set)
    PYTHONUNBUFFERED=1                 unless already set, so Python ranks' output is live

Stdin of every child is /dev/null (the ranks run in their own process groups, so they
could not read the terminal anyway).

Output: each child's stdout and stderr are read line by line and written to the
launcher's stdout and stderr with a ``[rank N] `` prefix (every pipe is drained all the
time, so a chatty child never blocks on a full pipe, and no line is lost or interleaved).

Failing together: when a child exits non-zero the launcher sends SIGTERM (then SIGCONT,
so a stopped rank acts on it) to every other child's process group, SIGKILL to those
still alive after ``grace_period`` seconds, and reports e.g. ``netdist launch: rank 2
exited with code 3; terminated ranks 0, 1, 3``. Once every rank has exited and its output
is drained, it prints a summary (``netdist.launch_report``): the rank that went away first
-- stopped, left early with code 0 while others still ran, or failed first -- with its
own error (the end of its last traceback, kept from its stderr), then every other rank in
one line, in the order they exited (``rank 2: PeerLostError: ... (exit code 1; a
consequence)``). The summary is left out when it would only repeat the one-line report.

Exit codes of ``launch()``:

- 0 when every rank exited 0;
- the first failing rank's exit code, or 128 + N when it was killed by signal N
  (the shell's convention: a rank killed by SIGKILL gives 137);
- 130 / 143 when the launcher itself received SIGINT / SIGTERM (children are terminated);
- 124 when the whole-job ``timeout`` expired (as coreutils ``timeout``);
- 127 / 126 when the command could not be started (not found / not executable).

A second SIGINT or SIGTERM while children are being terminated skips the grace period
and kills them at once. POSIX only (process groups).

Elastic mode (``elastic=True``, ``netdist launch --elastic``): the job is a set of *slots*,
``0..nprocs-1`` for the initial ranks and ``nprocs..nprocs+spares-1`` for spares, all
started at once. A process that exits non-zero or is killed by a signal is restarted
alone, in the same slot, while the others keep running: ``max_restarts`` counts per slot
(``netdist launch: slot 3 (pid 1234) was killed by signal 9 (SIGKILL); restarting it
(restart 1 of 2)``); what it left in its process group is SIGKILLed first. A slot that has
used its restarts stays down, and the job fails (with that process's status) once fewer
than ``min_nodes`` slots are running, restartable or finished. A process that exits 0 is
never restarted; the job succeeds when every slot that is not down has exited 0. Signals
and the timeout stop every slot as in a fixed job; there is no failure summary. Output is
prefixed ``[slot N] ``. Every process gets, besides the variables above (the coordinator,
``MASTER_PORT``, token and job id fixed for the whole run)::

    NETDIST_ELASTIC=1
    NETDIST_ELASTIC_SLOT               its slot
    NETDIST_ELASTIC_PORT               its slot's port on NETDIST_ELASTIC_HOST, chosen free
                                       once at start (the launcher holds no socket) and kept
                                       across the slot's restarts
    NETDIST_ELASTIC_HOST               from the environment, default 127.0.0.1
    NETDIST_ELASTIC_SEEDS              host:port of every slot, in slot order, comma-separated
    NETDIST_ELASTIC_MIN                min_nodes (default: a strict majority, nprocs // 2 + 1)
    NETDIST_RESTART_COUNT              this slot's own restart count
    NETDIST_WORLD_SIZE                 nprocs, the initial world size (spares not counted)
    NETDIST_RANK, RANK, LOCAL_RANK     the slot, for initial slots; unset for spares

Dying with the launcher: a SIGKILLed launcher cannot clean up, so on Linux each child is
started through a tiny wrapper (``python -I -S -c``, about 10 ms) that sets
``PR_SET_PDEATHSIG`` to SIGKILL and then ``exec``s the command, keeping the pid, the
process group and the parent: when the launcher dies, the kernel kills every rank, Python
or not. A wrapper rather than ``preexec_fn``, because ``preexec_fn`` runs Python in the
forked child of a multi-threaded process (the launcher's waiter threads), which may
deadlock, and it disables ``posix_spawn``. The wrapper checks that its parent is still
the launcher after ``prctl`` (no window where a launcher death goes unnoticed) and reports
an ``exec`` failure over a close-on-exec pipe, so a missing command still gives 127 with
the usual message. The signal is tied to the thread that called ``launch()``, which stays
in ``launch()`` until its children are gone. Processes a rank starts itself are not
covered (the rank can ask for the same with ``prctl``). Elsewhere children are started
directly and outlive a SIGKILLed launcher.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, TextIO, cast

from netdist.config import (
    CONFIG_VARIABLES,
    SET_BY_LAUNCHERS,
    parse_host_port,
    validate_environment,
)
from netdist.errors import ConfigError
from netdist.launch_report import (
    RankExit,
    describe_exit,
    rank_list,
    summarize_failure,
    worth_printing,
)

__all__ = [
    "launch",
    "check_environment",
    "DEFAULT_GRACE_PERIOD",
    "EXIT_TIMEOUT",
    "EXIT_CANNOT_EXECUTE",
    "EXIT_NOT_FOUND",
]

DEFAULT_GRACE_PERIOD = 5.0
"""Seconds between SIGTERM and SIGKILL when children are terminated."""

EXIT_TIMEOUT = 124
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

_logger = logging.getLogger(__name__)

_DRAIN_TIMEOUT = 2.0
"""How long output is still read after every rank exited (a leftover background
process may hold a rank's pipe open forever)."""

_MAX_PARTIAL_LINE = 64 * 1024
"""A line longer than this is written out in pieces rather than buffered without bound."""

_READ_SIZE = 64 * 1024
_PREFIX = "netdist launch: "

_ELASTIC_HOST = "NETDIST_ELASTIC_HOST"
_ELASTIC_VARIABLES = frozenset({
    "NETDIST_ELASTIC", "NETDIST_ELASTIC_SLOT", "NETDIST_ELASTIC_PORT", _ELASTIC_HOST,
    "NETDIST_ELASTIC_SEEDS", "NETDIST_ELASTIC_MIN",
})
"""What ``launch(elastic=True)`` sets for the elastic runtime (module docstring)."""

_TAIL_LINES = 200
"""Lines of each rank's stderr kept for the failure summary."""

_TAIL_LINE_CHARS = 2000
"""Longer stderr lines are cut to this many characters in the kept tail."""

_EXEC_REPORT_TIMEOUT = 60.0
"""How long the parent-death wrapper may take to ``exec`` the command or report why not."""

_PDEATHSIG_WRAPPER = r"""
import ctypes, os, sys
launcher, report = int(sys.argv[1]), int(sys.argv[2])
cmd = sys.argv[3:]
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: die with the launcher
except (OSError, AttributeError):
    pass  # no prctl: run without it, as on other systems
if os.getppid() != launcher:  # the launcher died before prctl took effect
    os._exit(137)
os.set_inheritable(report, False)
try:
    os.execvp(cmd[0], cmd)
except OSError as exc:
    os.write(report, str(exc.errno or 0).encode())
    os._exit(127)
"""
"""Run as ``python -I -S -c WRAPPER LAUNCHER_PID REPORT_FD CMD...`` (module docstring)."""


# --------------------------------------------------------------------------- helpers


def _exit_status(returncode: int) -> int:
    """Shell-style status: the exit code, or 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _free_port(host: str, avoid: int | None) -> int:
    """A port the OS reports free on ``host`` right now, different from ``avoid``."""
    port = 0
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != avoid:
            break
    return port


def _set_torch_master(attempt_env: dict[str, str], base_env: Mapping[str, str],
                      coordinator: str) -> None:
    """``MASTER_ADDR`` / ``MASTER_PORT`` for torch.distributed code in the ranks: the
    coordinator's host and a second free port, never netdist's own coordinator port
    (torch's store listens on MASTER_PORT). Values the caller set are kept."""
    host, port = parse_host_port(coordinator, what="coordinator")
    attempt_env["MASTER_ADDR"] = base_env.get("MASTER_ADDR") or host
    if not base_env.get("MASTER_PORT"):
        attempt_env["MASTER_PORT"] = str(_free_port("127.0.0.1", avoid=port))


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group led by ``pid``; a vanished group is fine."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/<pid>/stat`` (``T``: stopped); ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode("ascii", "replace") if fields else None


def _use_pdeathsig_wrapper() -> bool:
    """Whether children are started through ``_PDEATHSIG_WRAPPER`` (Linux with an interpreter)."""
    return sys.platform.startswith("linux") and bool(sys.executable)


def _read_exec_report(fd: int) -> int | None:
    """Wait for the wrapper to ``exec`` (EOF: ``None``) or report the ``errno`` of its failure."""
    data = b""
    deadline = time.monotonic() + _EXEC_REPORT_TIMEOUT
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                return errno.ETIMEDOUT
            chunk = os.read(fd, 64)
            if not chunk:
                break
            data += chunk
    if not data:
        return None
    return (int(data) or errno.ENOEXEC) if data.isdigit() else errno.ENOEXEC


def _log(message: str) -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        print(_PREFIX + message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _Sink:
    """One of the launcher's output streams; writes whole chunks and never raises.

    A closed or broken stream (``netdist launch ... | head``) is remembered and further
    output is dropped, while the children's pipes keep being drained.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._broken = stream is None  # e.g. sys.stdout is None under pythonw

    def write(self, data: bytes) -> None:
        if self._broken or self._stream is None:
            return
        try:
            buffer = getattr(self._stream, "buffer", None)
            if buffer is not None:
                self._stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                self._stream.write(data.decode("utf-8", errors="replace"))
                self._stream.flush()
        except (OSError, ValueError):
            self._broken = True


class _LineSplitter:
    """Turns a child's byte stream into ``[rank N] ``-prefixed lines for one sink.

    With ``tail``, the last lines are also kept there (decoded, cut to
    ``_TAIL_LINE_CHARS``) for the failure summary.
    """

    def __init__(self, prefix: bytes, sink: _Sink, tail: deque[str] | None = None) -> None:
        self._prefix = prefix
        self._sink = sink
        self._tail = tail
        self._partial = b""

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _MAX_PARTIAL_LINE:
            lines.append(self._partial)
            self._partial = b""
        if lines:
            self._sink.write(b"".join(self._prefix + line + b"\n" for line in lines))
            self._keep(lines)

    def close(self) -> None:
        """Flush a last line that had no newline."""
        if self._partial:
            self._sink.write(self._prefix + self._partial + b"\n")
            self._keep([self._partial])
            self._partial = b""

    def _keep(self, lines: list[bytes]) -> None:
        if self._tail is not None:
            for line in lines[-_TAIL_LINES:]:
                text = line[:_TAIL_LINE_CHARS * 4].decode("utf-8", errors="replace")
                self._tail.append(text.rstrip("\r")[:_TAIL_LINE_CHARS])


class _Wakeup:
    """A self-pipe that wakes the launcher's ``select``: child exits and signals.

    Waiter threads write a byte when their child is reaped. When ``launch()`` runs in the
    main thread, SIGINT/SIGTERM handlers only record the signal, and
    ``signal.set_wakeup_fd`` makes the C-level handler write to the same pipe, so a signal
    is never lost between a check and the wait, and no exception is ever raised in the
    middle of spawning or cleaning up.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.signals: list[int] = []
        self._saved_handlers: dict[int, Any] = {}
        self._saved_wakeup_fd: int | None = None

    def __enter__(self) -> _Wakeup:
        if threading.current_thread() is threading.main_thread():
            self._saved_wakeup_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            for signum in self._SIGNALS:
                current = signal.getsignal(signum)
                if current is signal.SIG_IGN:
                    continue  # started with the signal ignored (e.g. `nohup`): keep it so
                self._saved_handlers[signum] = current
                signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)
        if self._saved_wakeup_fd is not None:
            signal.set_wakeup_fd(self._saved_wakeup_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def notify(self) -> None:
        """Wake the main loop (called from waiter threads)."""
        try:
            os.write(self.write_fd, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full, so the reader will wake anyway; or we are closing

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass


def _popen(cmd: list[str], env: dict[str, str], pipe: int | None) -> subprocess.Popen[bytes]:
    """Start one rank in its own process group, through the parent-death wrapper on Linux.

    Raises ``OSError`` (``FileNotFoundError``, ``PermissionError``, ...) with the command
    as the file name when it cannot be started, as ``subprocess.Popen`` does.
    """
    if not _use_pdeathsig_wrapper():
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=pipe,
                                stderr=pipe, process_group=0, close_fds=True)
    read_fd, write_fd = os.pipe()
    try:
        wrapped = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_WRAPPER, str(os.getpid()),
                   str(write_fd), *cmd]
        proc = subprocess.Popen(wrapped, env=env, stdin=subprocess.DEVNULL, stdout=pipe,
                                stderr=pipe, process_group=0, close_fds=True,
                                pass_fds=(write_fd,))
        os.close(write_fd)
        write_fd = -1
        failure = _read_exec_report(read_fd)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
    if failure is None:
        return proc
    reason = os.strerror(failure)
    if failure == errno.ETIMEDOUT:
        _signal_group(proc.pid, signal.SIGKILL)
        reason = f"not started within {_EXEC_REPORT_TIMEOUT:g} s"
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    proc.wait()
    raise OSError(failure, reason, cmd[0])


# --------------------------------------------------------------------------- one attempt


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one start of the job ended."""

    status: int
    restartable: bool


class _Child:
    """One rank's process and the bookkeeping the main loop needs."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.proc = proc
        self.exit_time = 0.0  # time.monotonic() when reaped; set before exit_seq
        self.returncode = 0  # the exit code once reaped (read only when exited); ditto
        self.exit_seq: int | None = None  # set by the waiter thread after reaping
        self.stderr_tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.stopped = False  # stopped (state T) when the job's failure was detected

    @property
    def exited(self) -> bool:
        return self.exit_seq is not None


class _Attempt:
    """Start every rank once, watch them, and tear the job down as a unit.

    ``_ElasticRun`` keeps this machinery (spawning, output, termination) and replaces the
    policy: the hooks ``_child_env``, ``_names``, ``_current`` and ``_check``.
    """

    _noun = "rank"

    def __init__(self, *, cmd: list[str], nprocs: int, env: dict[str, str],
                 prefix_output: bool, deadline: float | None, timeout: float | None,
                 grace_period: float, wakeup: _Wakeup, sinks: tuple[_Sink, _Sink]) -> None:
        self.cmd = cmd
        self.nprocs = nprocs
        self.env = env
        self.prefix_output = prefix_output
        self.deadline = deadline
        self.timeout = timeout
        self.grace_period = grace_period
        self.wakeup = wakeup
        self.sinks = sinks
        self.children: list[_Child] = []
        self.waiters: list[threading.Thread] = []
        self.selector = selectors.DefaultSelector()
        self.exit_counter = itertools.count()
        self.open_pipes = 0
        self.handled_signals = 0
        self.kill_at: float | None = None  # SIGKILL time once terminating
        self.terminated_at = float("inf")  # time.monotonic() of the SIGTERM, once sent
        self.killed = False
        self.terminating = False
        self.rank_failed = False  # the job ended because a rank exited non-zero

    # -- spawning -------------------------------------------------------------------

    def _child_env(self, rank: int) -> dict[str, str]:
        """The environment of ``rank``'s process."""
        env = dict(self.env)
        env.update({
            "NETDIST_RANK": str(rank),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        })
        return env

    def _names(self, ranks: Sequence[int]) -> str:
        """``"rank 3"`` / ``"ranks 0, 1"`` for messages."""
        return rank_list(ranks)

    def _current(self) -> list[_Child]:
        """The processes termination signals: every child started."""
        return self.children

    def _spawn(self, rank: int) -> _Child:
        pipe = subprocess.PIPE if self.prefix_output else None
        proc = _popen(self.cmd, self._child_env(rank), pipe)
        child = _Child(rank, proc)
        self.children.append(child)
        for stream, sink in ((proc.stdout, self.sinks[0]), (proc.stderr, self.sinks[1])):
            if stream is not None:
                tail = child.stderr_tail if stream is proc.stderr else None
                splitter = _LineSplitter(f"[{self._noun} {rank}] ".encode(), sink, tail)
                self.selector.register(stream, selectors.EVENT_READ, splitter)
                self.open_pipes += 1
        waiter = threading.Thread(target=self._wait_for, args=(child,), daemon=True,
                                  name=f"netdist-launch-{self._noun}-{rank}")
        waiter.start()
        self.waiters.append(waiter)
        return child

    def _wait_for(self, child: _Child) -> None:
        child.returncode = child.proc.wait()
        child.exit_time = time.monotonic()
        child.exit_seq = next(self.exit_counter)
        self.wakeup.notify()

    # -- I/O ------------------------------------------------------------------------

    def _pump(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for output, a child exit or a signal, and handle output."""
        for key, _ in self.selector.select(timeout):
            if key.fileobj == self.wakeup.read_fd:
                self.wakeup.drain()
                continue
            # besides the wakeup fd only Popen's stdout/stderr pipes are registered
            stream = cast(IO[bytes], key.fileobj)
            splitter: _LineSplitter = key.data
            try:
                data = os.read(key.fd, _READ_SIZE)
            except BlockingIOError:  # pragma: no cover - select said readable
                continue
            except OSError as exc:  # pragma: no cover - e.g. EIO; treat as end of stream
                if exc.errno not in (errno.EIO, errno.EBADF):
                    raise
                data = b""
            if data:
                splitter.feed(data)
            else:
                splitter.close()
                self.selector.unregister(stream)
                stream.close()
                self.open_pipes -= 1

    # -- termination ----------------------------------------------------------------

    def _terminate(self) -> list[int]:
        """SIGTERM every rank's process group; return the ranks that were still running.

        SIGCONT follows, so a stopped rank acts on the SIGTERM instead of waiting for
        the SIGKILL at the end of the grace period.
        """
        self.terminating = True
        self.terminated_at = time.monotonic()
        self.kill_at = self.terminated_at + self.grace_period
        running = []
        for child in self._current():
            if not child.exited:
                running.append(child.rank)
            _signal_group(child.proc.pid, signal.SIGTERM)
            _signal_group(child.proc.pid, signal.SIGCONT)
        return running

    def _kill_remaining(self, why: str) -> None:
        """SIGKILL the process group of every rank still running, saying ``why``."""
        stubborn = [c.rank for c in self._current() if not c.exited]
        if stubborn:
            _log(why.format(ranks=self._names(stubborn)))
        for child in self._current():
            if not child.exited:
                _signal_group(child.proc.pid, signal.SIGKILL)
        self.killed = True

    def _kill_if_overdue(self, now: float) -> None:
        if self.terminating and not self.killed and self.kill_at is not None \
                and now >= self.kill_at:
            self._kill_remaining(
                f"{{ranks}} still running {self.grace_period:g} s after SIGTERM; sent SIGKILL")

    # -- main loop ------------------------------------------------------------------

    def run(self) -> _Outcome:
        self.selector.register(self.wakeup.read_fd, selectors.EVENT_READ, None)
        try:
            return self._run()
        except BaseException:
            for child in self.children:  # never leave a rank behind, even on a bug
                if not child.exited:
                    _signal_group(child.proc.pid, signal.SIGKILL)
            raise
        finally:
            for key in list(self.selector.get_map().values()):
                if key.fileobj != self.wakeup.read_fd:
                    key.data.close()
                    cast(IO[bytes], key.fileobj).close()  # a child's stdout/stderr pipe
            self.selector.close()
            for waiter in self.waiters:
                waiter.join()

    def _run(self) -> _Outcome:
        for rank in range(self.nprocs):
            try:
                self._spawn(rank)
            except OSError as exc:
                status = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE
                _log(f"cannot start {self._noun} {rank}: {exc}")
                if self.children:
                    running = self._terminate()
                    self._finish_termination()
                    _log(f"terminated {self._names(running)}")
                return _Outcome(status, restartable=False)
            if self.wakeup.signals:
                break  # stop spawning; the loop below handles the signal

        reported: _Outcome | None = None
        while True:
            now = time.monotonic()
            # Taken before _check, so that _check has seen every exit when the loop ends.
            settled = all(c.exited for c in self.children)
            if reported is None:
                reported = self._check(now)
            if len(self.wakeup.signals) > self.handled_signals:
                signum = self.wakeup.signals[self.handled_signals]
                self.handled_signals = len(self.wakeup.signals)
                if self.terminating and not self.killed:  # impatient: no more waiting
                    self._kill_remaining(
                        f"received {signal.Signals(signum).name}; sent SIGKILL to {{ranks}}")
            self._kill_if_overdue(now)
            if settled and all(c.exited for c in self.children):  # none restarted
                break
            self._pump(self._wait_time(now))

        if self.terminating:
            # Stragglers a rank left behind in its process group go too.
            for child in self._current():
                _signal_group(child.proc.pid, signal.SIGKILL)
        self._drain_output()
        if self.rank_failed:
            self._print_summary()
        if reported is None:  # pragma: no cover - _check reports before all exit
            reported = _Outcome(0, restartable=False)
        return reported

    def _print_summary(self) -> None:
        """The failure summary (``netdist.launch_report``), once every rank has exited."""
        exits = [RankExit(rank=c.rank, returncode=c.returncode, order=c.exit_seq or 0,
                          stderr_tail=tuple(c.stderr_tail),
                          after_terminate=c.exit_time > self.terminated_at,
                          stopped=c.stopped)
                 for c in self.children if c.exited]
        if worth_printing(exits):
            for line in summarize_failure(exits):
                _log(line)

    def _wait_time(self, now: float) -> float | None:
        limits = []
        if not self.terminating and self.deadline is not None:
            limits.append(self.deadline - now)
        if self.terminating and not self.killed and self.kill_at is not None:
            limits.append(self.kill_at - now)
        return max(0.0, min(limits)) if limits else None

    def _check(self, now: float) -> _Outcome | None:
        """Decide whether the job has ended, and start tearing it down if so."""
        if self.wakeup.signals:
            return self._stop_for_signal()
        failed = sorted((c for c in self.children if c.exited and c.returncode != 0),
                        key=lambda c: c.exit_seq or 0)
        if failed:
            first = failed[0]
            for child in self.children:  # before SIGCONT: who had stopped answering?
                child.stopped = not child.exited and _process_state(child.proc.pid) == "T"
            self.rank_failed = True
            running = self._terminate()
            message = f"rank {first.rank} {describe_exit(first.returncode)}"
            _log(f"{message}; terminated {self._names(running)}" if running else message)
            return _Outcome(_exit_status(first.returncode), restartable=True)
        if self.deadline is not None and now >= self.deadline:
            return self._stop_for_timeout()
        if all(c.exited for c in self.children):
            return _Outcome(0, restartable=False)
        return None

    def _stop_for_signal(self) -> _Outcome:
        """Tear the job down for the first signal the launcher received."""
        signum = self.wakeup.signals[0]
        self.handled_signals = len(self.wakeup.signals)
        running = self._terminate()
        message = f"received {signal.Signals(signum).name}"
        _log(f"{message}; terminated {self._names(running)}" if running else message)
        return _Outcome(128 + signum, restartable=False)

    def _stop_for_timeout(self) -> _Outcome:
        """Tear the job down because ``timeout`` expired."""
        running = self._terminate()
        _log(f"job timed out after {self.timeout:g} s; terminated {self._names(running)}")
        return _Outcome(EXIT_TIMEOUT, restartable=False)

    def _finish_termination(self) -> None:
        """Wait (bounded by the grace period) for signalled children, then kill them."""
        while not all(c.exited for c in self.children):
            now = time.monotonic()
            self._kill_if_overdue(now)
            self._pump(self._wait_time(now))
        for child in self._current():
            _signal_group(child.proc.pid, signal.SIGKILL)
        self._drain_output()

    def _drain_output(self) -> None:
        """Read what the children wrote before exiting, bounded by ``_DRAIN_TIMEOUT``."""
        stop = time.monotonic() + _DRAIN_TIMEOUT
        while self.open_pipes:
            remaining = stop - time.monotonic()
            if remaining <= 0:
                _log("a rank's output is still held open by a leftover process; not waiting")
                return
            self._pump(remaining)


# --------------------------------------------------------------------------- elastic


def _slot_list(slots: Sequence[int]) -> str:
    """``"slot 3"`` or ``"slots 0, 1, 2"``."""
    noun = "slot" if len(slots) == 1 else "slots"
    return f"{noun} {', '.join(str(s) for s in slots)}"


def _free_ports(host: str, count: int, avoid: set[int]) -> list[int]:
    """``count`` distinct ports the OS reports free on ``host`` now, none of them in ``avoid``.

    Every socket is closed before this returns: the slots bind these ports themselves.
    Raises ``ConfigError`` when ``host`` cannot be bound.
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            if len(sockets) > count + 64:  # pragma: no cover - avoid holds a handful at most
                raise ConfigError(f"cannot find {count} free ports on {host!r}")
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            try:
                sock.bind((bare, 0))
            except OSError as exc:
                raise ConfigError(f"{_ELASTIC_HOST}={host!r}: cannot bind a port there "
                                  f"({exc})") from None
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


class _ElasticRun(_Attempt):
    """An elastic job (``launch(elastic=True)``): a slot that fails is restarted alone.

    Slots ``0..initial-1`` are the initial ranks, the rest spares. A slot that exits
    non-zero (or is killed by a signal) gets SIGKILL for what it left in its process
    group, then a new process with the same environment but ``NETDIST_RESTART_COUNT``
    one higher, up to ``max_restarts`` times; after that it stays down. A slot that exits
    0 is done. The job fails when fewer than ``min_nodes`` slots are running, restartable
    or done; it succeeds when every slot that is not down has exited 0. A signal to the
    launcher and the timeout tear every slot down as in a fixed job.
    """

    _noun = "slot"

    def __init__(self, *, ports: Sequence[int], initial: int, max_restarts: int,
                 min_nodes: int, **kwargs: Any) -> None:
        super().__init__(nprocs=len(ports), **kwargs)
        self.ports = list(ports)
        self.initial = initial
        self.max_restarts = max_restarts
        self.min_nodes = min_nodes
        self.restarts = [0] * len(self.ports)
        self.slots: dict[int, _Child] = {}  # the newest process of every started slot
        self.down: list[int] = []  # slots that failed with no restart left, in that order
        self.handled: set[_Child] = set()  # exited processes already acted on

    def _child_env(self, rank: int) -> dict[str, str]:
        env = dict(self.env)
        env["NETDIST_ELASTIC_SLOT"] = str(rank)
        env["NETDIST_ELASTIC_PORT"] = str(self.ports[rank])
        env["NETDIST_RESTART_COUNT"] = str(self.restarts[rank])
        if rank < self.initial:
            env.update({"NETDIST_RANK": str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank)})
        else:  # a spare has no rank until the elastic runtime gives it one
            for name in ("NETDIST_RANK", "RANK", "LOCAL_RANK"):
                env.pop(name, None)
        return env

    def _names(self, ranks: Sequence[int]) -> str:
        return _slot_list(ranks)

    def _current(self) -> list[_Child]:
        return list(self.slots.values())

    def _spawn(self, rank: int) -> _Child:
        child = super()._spawn(rank)
        self.slots[rank] = child
        return child

    def _check(self, now: float) -> _Outcome | None:
        if self.wakeup.signals:
            return self._stop_for_signal()
        if self.deadline is not None and now >= self.deadline:
            return self._stop_for_timeout()
        exited = sorted((c for c in self.children if c.exited and c not in self.handled),
                        key=lambda c: c.exit_seq or 0)
        for child in exited:
            self.handled.add(child)
            if child.returncode != 0:
                outcome = self._on_failure(child)
                if outcome is not None:
                    return outcome
        if all(c.exited for c in self.slots.values()):
            if self.down:
                _log(f"job finished: {_slot_list(self.down)} stayed down, every other slot "
                     "exited 0")
            return _Outcome(0, restartable=False)
        return None

    def _on_failure(self, child: _Child) -> _Outcome | None:
        """Restart ``child``'s slot, or leave it down; an outcome when the job must end."""
        slot = child.rank
        what = f"slot {slot} (pid {child.proc.pid}) {describe_exit(child.returncode)}"
        # What the process left in its group goes too: it may hold the slot's port.
        _signal_group(child.proc.pid, signal.SIGKILL)
        if self.restarts[slot] < self.max_restarts:
            self.restarts[slot] += 1
            _log(f"{what}; restarting it (restart {self.restarts[slot]} of "
                 f"{self.max_restarts})")
            try:
                self._spawn(slot)
            except OSError as exc:
                _log(f"cannot restart slot {slot}: {exc}")
                running = self._terminate()
                if running:
                    _log(f"terminated {self._names(running)}")
                status = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) \
                    else EXIT_CANNOT_EXECUTE
                return _Outcome(status, restartable=False)
            return None
        self.down.append(slot)
        total = len(self.ports)
        left = total - len(self.down)
        _log(f"{what}; it stays down, no restart left ({self.max_restarts} of "
             f"{self.max_restarts} used); {left} of {total} slots left (minimum "
             f"{self.min_nodes})")
        if left >= self.min_nodes:
            return None
        running = self._terminate()
        message = (f"job failed: slot {slot} is down and only {left} of {total} slots are "
                   f"left, fewer than the minimum of {self.min_nodes}")
        _log(f"{message}; terminated {self._names(running)}" if running else message)
        return _Outcome(_exit_status(child.returncode), restartable=False)


# --------------------------------------------------------------------------- public


def check_environment(env: Mapping[str, str]) -> None:
    """Check every ``NETDIST_*`` variable in ``env`` that the ranks will read, with the
    code that reads it, and raise the first ``ConfigError``.

    ``launch()`` calls this before it starts any rank: a bad value is then one line from
    the launcher (``netdist launch: error: NETDIST_TIMEOUT='inf' is not ...``) rather than
    the same error from every rank. ``netdist.config.validate_environment`` holds the rules
    of the configuration layer; the parameter-server knobs and ``NETDIST_SHM_COPY`` are
    checked by their own readers (the launcher sits above them all). The variables the
    launcher sets itself are not checked; unknown ``NETDIST_*`` variables are no error
    (they may be the user's own, or another netdist version's) and are logged at debug
    level.
    """
    from netdist.ps.roles import (
        PS_MAX_STALENESS_ENV,
        PS_SERVERS_ENV,
        max_staleness_from_env,
        num_servers_from_env,
    )

    from netdist.trace.prometheus import METRICS_HOST_ENV, METRICS_PORT_ENV, MetricsSettings
    from netdist.trace.settings import TRACE_VARIABLES, TraceSettings

    validate_environment(env)
    TraceSettings.from_env(env)
    MetricsSettings.from_env(env)
    num_servers_from_env(env)
    max_staleness_from_env(env)
    if env.get("NETDIST_SHM_COPY"):
        from netdist.collectives.host.settings import shared_memory_copy

        shared_memory_copy(None, environ=env)
    known = CONFIG_VARIABLES | SET_BY_LAUNCHERS | {
        PS_SERVERS_ENV, PS_MAX_STALENESS_ENV, "NETDIST_SHM_COPY", *_ELASTIC_VARIABLES,
        *TRACE_VARIABLES, METRICS_PORT_ENV, METRICS_HOST_ENV,
        "NETDIST_CHECKPOINT_FAILPOINT",  # a testing hook (netdist.checkpoint.commit)
    }
    unknown = sorted(name for name in env if name.startswith("NETDIST_") and name not in known)
    if unknown:
        _logger.debug("environment variables netdist does not read: %s", ", ".join(unknown))


def launch(
    cmd: Sequence[str],
    nprocs: int,
    *,
    coordinator: str | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    prefix_output: bool = True,
    timeout: float | None = None,
    job_id: str | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    elastic: bool = False,
    spares: int = 0,
    min_nodes: int | None = None,
) -> int:
    """Run ``cmd`` as ``nprocs`` local ranks of one job and return the job's exit status.

    ``coordinator`` (``host:port``) is passed to every rank as ``NETDIST_COORDINATOR``;
    when omitted, a free port on 127.0.0.1 is chosen (again on each restart). ``env``
    adds variables on top of the launcher's environment. ``NETDIST_TOKEN`` and
    ``NETDIST_JOB_ID`` are taken from that environment (``job_id`` wins) or generated.

    ``max_restarts=K`` restarts the whole job after a rank fails, up to K times, with
    ``NETDIST_RESTART_COUNT`` set to the restart number so the job can resume from its
    latest checkpoint. Signals to the launcher, the timeout and a command that cannot be
    started are never retried. ``timeout`` bounds the whole job, restarts included.
    ``grace_period`` is the time between SIGTERM and SIGKILL when ranks are terminated.

    ``elastic=True`` starts an elastic job instead (module docstring, "Elastic mode"):
    ``nprocs`` slots plus ``spares`` spare slots, each restarted alone, up to
    ``max_restarts`` times per slot, while the others keep running; the job fails once
    fewer than ``min_nodes`` slots (default: a strict majority of ``nprocs``) are running,
    restartable or done. ``spares`` and ``min_nodes`` need ``elastic=True``.

    Returns the exit status described in the module docstring. Raises ``ConfigError``
    for invalid arguments and for an invalid ``NETDIST_*`` variable in the ranks'
    environment (``check_environment``), before any rank is started. SIGINT/SIGTERM
    handling is installed only when called from the main thread, and the previous
    handlers are restored on return.
    """
    cmd = list(cmd)
    if not cmd or not all(isinstance(part, str) for part in cmd):
        raise ConfigError("launch needs a command: a non-empty list of strings")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"number of processes must be an integer >= 1, got {nprocs!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if timeout is not None and not 0 < timeout < float("inf"):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not 0 <= grace_period < float("inf"):
        raise ConfigError(f"grace_period must be >= 0 seconds, got {grace_period!r}")
    if job_id is not None and not job_id:
        raise ConfigError("job_id must not be empty")
    if not isinstance(elastic, bool):
        raise ConfigError(f"elastic must be True or False, got {elastic!r}")
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ConfigError(f"spares must be an integer >= 0, got {spares!r}")
    if min_nodes is not None and (isinstance(min_nodes, bool) or not isinstance(min_nodes, int)
                                  or not 1 <= min_nodes <= nprocs):
        raise ConfigError(f"min_nodes must be an integer from 1 to the number of processes "
                          f"({nprocs}), got {min_nodes!r}")
    if not elastic and (spares or min_nodes is not None):
        raise ConfigError(f"spares={spares!r} and min_nodes={min_nodes!r} need elastic=True "
                          "(a fixed job restarts as a whole)")
    fixed_coordinator = None
    if coordinator is not None:
        fixed_coordinator = _format_host_port(*parse_host_port(coordinator, what="coordinator"))

    base_env = dict(os.environ)
    if env is not None:
        base_env.update(env)
    check_environment(base_env)  # before any rank starts: one error, not one per rank
    base_env.update({
        "NETDIST_WORLD_SIZE": str(nprocs),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "NETDIST_TOKEN": base_env.get("NETDIST_TOKEN") or secrets.token_hex(32),
        "NETDIST_JOB_ID": job_id or base_env.get("NETDIST_JOB_ID") or f"job-{secrets.token_hex(6)}",
    })
    base_env.setdefault("PYTHONUNBUFFERED", "1")  # live output from Python ranks

    if elastic:
        return _launch_elastic(
            cmd, nprocs, base_env, coordinator=fixed_coordinator, spares=spares,
            min_nodes=nprocs // 2 + 1 if min_nodes is None else min_nodes,
            max_restarts=max_restarts, prefix_output=prefix_output, timeout=timeout,
            grace_period=grace_period)

    deadline = None if timeout is None else time.monotonic() + timeout
    sinks = (_Sink(sys.stdout), _Sink(sys.stderr))
    port: int | None = None
    with _Wakeup() as wakeup:
        restart = 0
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                _log(f"job timed out after {timeout:g} s")
                return EXIT_TIMEOUT
            if fixed_coordinator is None:
                port = _free_port("127.0.0.1", avoid=port)
                address = f"127.0.0.1:{port}"
            else:
                address = fixed_coordinator
            attempt_env = dict(base_env)
            attempt_env["NETDIST_COORDINATOR"] = address
            attempt_env["NETDIST_RESTART_COUNT"] = str(restart)
            _set_torch_master(attempt_env, base_env, address)
            outcome = _Attempt(cmd=cmd, nprocs=nprocs, env=attempt_env,
                               prefix_output=prefix_output, deadline=deadline,
                               timeout=timeout, grace_period=grace_period, wakeup=wakeup,
                               sinks=sinks).run()
            if outcome.status == 0 or not outcome.restartable:
                return outcome.status
            if wakeup.signals:  # arrived while the failed job was torn down
                return 128 + wakeup.signals[0]
            if restart >= max_restarts:
                if max_restarts:
                    _log(f"giving up after {max_restarts} restart"
                         f"{'s' if max_restarts != 1 else ''}")
                return outcome.status
            restart += 1
            _log(f"restarting the job ({restart} of {max_restarts})")


def _launch_elastic(cmd: list[str], nprocs: int, base_env: dict[str, str], *,
                    coordinator: str | None, spares: int, min_nodes: int, max_restarts: int,
                    prefix_output: bool, timeout: float | None, grace_period: float) -> int:
    """``launch(elastic=True)`` once the arguments are checked: one run, per-slot restarts.

    The coordinator address, ``MASTER_PORT`` and every slot's port are chosen once, so a
    restarted slot is found where it was.
    """
    env = dict(base_env)
    if coordinator is None:
        coordinator = f"127.0.0.1:{_free_port('127.0.0.1', avoid=None)}"
    env["NETDIST_COORDINATOR"] = coordinator
    env["NETDIST_RESTART_COUNT"] = "0"
    _set_torch_master(env, base_env, coordinator)
    avoid = {parse_host_port(coordinator, what="coordinator")[1]}
    if env.get("MASTER_PORT", "").isdigit():
        avoid.add(int(env["MASTER_PORT"]))
    host = base_env.get(_ELASTIC_HOST) or "127.0.0.1"
    ports = _free_ports(host, nprocs + spares, avoid)
    shown_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    env.update({
        "NETDIST_ELASTIC": "1",
        _ELASTIC_HOST: host,
        "NETDIST_ELASTIC_SEEDS": ",".join(f"{shown_host}:{port}" for port in ports),
        "NETDIST_ELASTIC_MIN": str(min_nodes),
    })
    deadline = None if timeout is None else time.monotonic() + timeout
    sinks = (_Sink(sys.stdout), _Sink(sys.stderr))
    with _Wakeup() as wakeup:
        run = _ElasticRun(ports=ports, initial=nprocs, max_restarts=max_restarts,
                          min_nodes=min_nodes, cmd=cmd, env=env, prefix_output=prefix_output,
                          deadline=deadline, timeout=timeout, grace_period=grace_period,
                          wakeup=wakeup, sinks=sinks)
        return run.run().status
