"""Start every rank of a test job and collect what each returns: the one place tests do it.

Pick the way by what the test needs:

**In one event loop** (everything above the transport; fast, deterministic):

- ``await run_ranks(n, body)``: ``n`` in-process transports, a ``Group`` on each,
  ``body(group)`` on every rank at once under one deadline, everything closed afterwards.
  Options: ``tcp=True`` for real TCP ranks on 127.0.0.1; your own transports or groups
  instead of ``n``; ``as_groups=False`` to hand ``body`` the transports;
  ``with_rank=True`` for ``body(rank, x)``; ``return_exceptions=True`` when a test checks
  what every rank raised; ``Group`` options (``timeout=``, ``small_message_bytes=``...)
  as keywords.
- ``await gather_ranks(bodies)``: bodies you built yourself (the servers and workers of a
  parameter-server job), run the same way.
- ``await start_until_blocked(coro)``: start one operation and return once it waits (a
  receive posted, a round begun, a close under way): the event that orders a test's next
  step, instead of guessing with ``asyncio.sleep(0)``.

**In threads**: ``on_every_rank(jobs, fn)`` drives blocking ranks (progress-thread
``Job`` objects), each from its own thread, as separate processes would.

**As processes** (real TCP between interpreters, kill -9, a fresh ``sys.modules``):

- ``start_ranks(n, module, args)``: ``python -m module args`` per rank with ``NETDIST_*``
  set as a launcher would; ``start_processes(argvs)`` for any other command lines. Both
  return ``RankProcess`` objects (read output line by line with ``expect``, every wait
  bounded); ``finish_ranks(procs, timeout)`` waits for all of them under one deadline.
- ``run_spawned(target, n, out_dir)``: a module-level function in ``n`` fresh
  ``spawn``-ed interpreters, failures reported with every rank's traceback (the torch
  tests, ``tests/torch/torch_ranks.py``).

Every wait here is bounded; nothing outlives the call that started it unless the caller
holds it (``RankProcess``, which a test kills in ``finally``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import secrets
import select
import socket
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from netdist.collectives import Group
    from netdist.transport import Transport

# Only the standard library at import time: ``run_spawned``'s children import this module
# to find their entry point, and should not pay for netdist or pytest.

T = TypeVar("T")
X = TypeVar("X")

REPO = Path(__file__).resolve().parents[1]

GUARD = 60.0
"""Outer bound on a whole multi-rank run; tests give operations much smaller timeouts."""

OP_TIMEOUT = 10.0
"""Per-operation timeout of the in-process transports ``run_ranks`` makes."""

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Variables other launchers set, removed from rank processes so only ``NETDIST_*`` count."""


# --------------------------------------------------------------------- in one event loop


async def gather_ranks(bodies: Iterable[Callable[[], Awaitable[Any]]], *,
                       guard: float = GUARD, return_exceptions: bool = False) -> list[Any]:
    """Call every body and run them concurrently; their results, in order.

    All of it must finish within ``guard`` seconds (``TimeoutError`` otherwise, every body
    cancelled). With ``return_exceptions`` a body's exception is its result, for tests
    that check what each rank raised; without, the first exception propagates.
    """
    async with asyncio.timeout(guard):
        return list(await asyncio.gather(*(body() for body in bodies),
                                         return_exceptions=return_exceptions))


async def run_ranks(ranks: int | Sequence[Transport] | Sequence[Group],
                    body: Callable[..., Awaitable[Any]], *, tcp: bool = False,
                    as_groups: bool = True, with_rank: bool = False, close: bool = False,
                    guard: float = GUARD, op_timeout: float = OP_TIMEOUT,
                    return_exceptions: bool = False, **group_options: Any) -> list[Any]:
    """Run ``body`` on every rank in this event loop; its results, in rank order.

    ``ranks`` is one of

    - a world size ``n``: ``n`` transports with per-operation timeout ``op_timeout``,
      made here and closed afterwards: in-process ones, or with ``tcp=True`` real
      ``TcpTransport`` ranks connected over 127.0.0.1 (``create_local_tcp_group``);
    - transports (TCP ones from ``local_tcp_group``, say): the caller's, closed here only
      with ``close=True``;
    - ``Group`` objects: the caller's, handed to ``body`` as they are and closed here (with
      their transports) only with ``close=True``.

    Transports are wrapped in ``Group(transport, **group_options)`` (made here, closed
    afterwards) unless ``as_groups=False``, which hands ``body`` the transports.
    ``body(x)`` is called per rank, or ``body(rank, x)`` with ``with_rank=True``.
    ``guard`` and ``return_exceptions`` are as for :func:`gather_ranks`.
    """
    from netdist.collectives import Group
    from netdist.transport import InProcessTransport, create_local_tcp_group

    if tcp and not isinstance(ranks, int):
        raise ValueError("tcp=True makes the transports: pass a world size, not transports")
    made: list[Transport] | None = None
    given: list[Any]
    if isinstance(ranks, int):
        made = given = (list(await create_local_tcp_group(ranks, timeout=op_timeout)) if tcp
                        else list(InProcessTransport.create_group(ranks, timeout=op_timeout)))
    else:
        given = list(ranks)
    given_groups = any(isinstance(item, Group) for item in given)
    if group_options and (given_groups or not as_groups):
        raise ValueError(f"group options {sorted(group_options)} need transports to wrap "
                         "(as_groups=True)")
    groups: list[Group] = []
    try:
        if as_groups and not given_groups:
            groups = [Group(transport, **group_options) for transport in given]
        targets: list[Any] = groups or given
        return await gather_ranks(
            [functools.partial(body, rank, x) if with_rank else functools.partial(body, x)
             for rank, x in enumerate(targets)],
            guard=guard, return_exceptions=return_exceptions)
    finally:
        for group in groups:
            await group.aclose()
        if made is not None or close:
            for item in given:
                await item.aclose()
            for item in given:
                if isinstance(item, Group):
                    await item.transport.aclose()


async def start_until_blocked(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start ``coro`` as a task; return the task once the coroutine first waits.

    "That operation is waiting now" (a receive posted, a collective begun, a close under
    way) is what a test means to establish before its next step. This resolves a future
    at the coroutine's first suspension, or at its end if it never suspends, instead of
    counting loop turns with ``asyncio.sleep(0)``.
    """
    waiting: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run() -> T:
        return await _signalling_first_wait(coro, waiting)

    task = asyncio.ensure_future(run())
    task.add_done_callback(lambda _: _resolve(waiting))  # cancelled before it started
    await waiting
    return task


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@types.coroutine
def _signalling_first_wait(coro: Coroutine[Any, Any, T],
                           waiting: asyncio.Future[None]) -> Generator[Any, Any, T]:
    """``await coro``, resolving ``waiting`` when ``coro`` first suspends (or ends)."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        _resolve(waiting)
        return stop.value
    except BaseException:
        _resolve(waiting)
        raise
    _resolve(waiting)
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # cancellation and errors go into the coroutine
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value


# ---------------------------------------------------------------------------- in threads


def on_every_rank(ranks: Sequence[X], fn: Callable[[X], T], *,
                  timeout: float = GUARD) -> list[T]:
    """``fn(rank)`` for every rank object (a ``Job``, say), each in its own thread, as
    separate processes would; the results in order, each waited for at most
    ``timeout`` seconds."""
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(fn, rank) for rank in ranks]
        return [future.result(timeout) for future in futures]


# -------------------------------------------------------------------------- as processes


def _fail(message: str) -> NoReturn:
    import pytest

    pytest.fail(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for coordinators in tests)."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world_size: int, coordinator: str, token: str, job: str, *,
             timeout: float = 20.0, keep: Iterable[str] = ()) -> dict[str, str]:
    """The environment a launcher gives rank ``rank``: this one, minus every ``NETDIST_*``
    variable but those in ``keep`` and other launchers' variables, plus the job's."""
    kept = set(keep)
    env = {name: value for name, value in os.environ.items()
           if (not name.startswith("NETDIST_") or name in kept)
           and name not in LAUNCHER_VARIABLES}
    env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(world_size),
               NETDIST_COORDINATOR=coordinator, NETDIST_TOKEN=token, NETDIST_JOB_ID=job,
               NETDIST_TIMEOUT=str(timeout), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return env


class RankProcess:
    """One rank's ``python ARGV`` process (stdin piped); reads its output with deadlines.

    stderr goes into the same stream as stdout unless ``merge_stderr=False``.
    """

    def __init__(self, rank: int, argv: Sequence[str], env: Mapping[str, str], *,
                 merge_stderr: bool = True) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, env=dict(env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, bufsize=0)
        self.output = b""
        self.errors = b""
        self._pending = b""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def expect(self, prefix: str, timeout: float) -> str:
        """The first output line starting with ``prefix``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.decode(errors="replace").startswith(prefix):
                    return line.decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                _fail(f"rank {self.rank}: no {prefix!r} line within {timeout}s; "
                            f"output:\n{self.text()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait(timeout=10)
                    _fail(f"rank {self.rank} exited ({self.proc.returncode}) before "
                                f"printing {prefix!r}; output:\n{self.text()}")
                self.output += chunk
                self._pending += chunk

    def send_line(self, line: str) -> None:
        """Write ``line`` to the process's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> int:
        """Wait for exit (bounded), collecting the rest of the output; the exit code."""
        if not self._communicate(timeout):
            self.kill()
            _fail(f"rank {self.rank} did not exit within {timeout}s; output:\n"
                        f"{self.text()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def _communicate(self, timeout: float) -> bool:
        """Read everything until exit; False if it is still running after ``timeout``."""
        if self.proc.stdout is None or self.proc.stdout.closed:
            try:
                self.proc.wait(timeout=max(timeout, 0.0))
            except subprocess.TimeoutExpired:
                return False
            return True
        try:
            rest, errors = self.proc.communicate(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        self.output += rest or b""
        self.errors += errors or b""
        return True

    def kill(self) -> None:
        """Kill if still running (stopped ones too), reap, keep what it printed, close the
        pipes. Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self._communicate(10.0)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def text(self) -> str:
        """Everything it printed so far (stdout, and stderr when merged)."""
        return self.output.decode(errors="replace")

    def error_text(self) -> str:
        """What it printed on stderr (empty when merged into ``text()``)."""
        return self.errors.decode(errors="replace")

    def completed(self) -> subprocess.CompletedProcess[str]:
        """The finished process as ``subprocess.run`` would report it."""
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           self.text(), self.error_text())


def start_processes(argvs: Sequence[Sequence[str]], *,
                    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
                    merge_stderr: bool = True) -> list[RankProcess]:
    """One ``python ARGV`` process per rank, ``argvs[rank]``.

    ``env`` is each process's whole environment, the same for every rank or ``env(rank)``;
    by default this process's, with the repository on ``PYTHONPATH``.
    """
    default = dict(os.environ, PYTHONPATH=str(REPO))
    return _start_all([(argv, default if env is None else env(rank) if callable(env) else env)
                       for rank, argv in enumerate(argvs)], merge_stderr=merge_stderr)


def start_ranks(world_size: int, module: str, args: Sequence[str], *, timeout: float = 20.0,
                job_prefix: str = "mp", keep: Iterable[str] = (),
                env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
                ) -> list[RankProcess]:
    """Start ``world_size`` ranks of ``python -m module args`` for one fresh job.

    Each rank gets ``rank_env`` (a fresh coordinator port on 127.0.0.1, token and job id;
    ``timeout`` as ``NETDIST_TIMEOUT``; ``keep`` names ``NETDIST_*`` variables to pass
    through) plus ``env``: extra variables, the same for every rank or ``env(rank)``.
    """
    port, token = free_port(), secrets.token_hex(16)
    job = f"{job_prefix}-{secrets.token_hex(3)}"
    commands = []
    for rank in range(world_size):
        extra = env(rank) if callable(env) else (env or {})
        variables = rank_env(rank, world_size, f"127.0.0.1:{port}", token, job,
                             timeout=timeout, keep=keep)
        commands.append((["-m", module, *args], {**variables, **extra}))
    return _start_all(commands)


def _start_all(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], *,
               merge_stderr: bool = True) -> list[RankProcess]:
    """One ``RankProcess`` per ``(argv, env)``; if one cannot start, the others are
    killed before the error propagates."""
    procs: list[RankProcess] = []
    try:
        for rank, (argv, env) in enumerate(commands):
            procs.append(RankProcess(rank, argv, env, merge_stderr=merge_stderr))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs


def finish_ranks(procs: Sequence[RankProcess], timeout: float,
                 ) -> list[subprocess.CompletedProcess[str]]:
    """Wait until every process has exited, all within ``timeout`` seconds; how each
    ended. If they do not, all are killed and the test fails showing every output."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            if not proc._communicate(deadline - time.monotonic()):
                for other in procs:
                    other.kill()
                _fail(f"ranks did not finish within {timeout}s:\n" + "\n".join(
                    f"--- rank {p.rank}\n{p.text()}{p.error_text()}" for p in procs))
    finally:
        for proc in procs:
            proc.kill()
    return [proc.completed() for proc in procs]


# ---------------------------------------------------------------- as spawned interpreters


class RankError(AssertionError):
    """One or more spawned rank processes failed, crashed or were killed on timeout.

    Subclasses ``AssertionError`` so pytest shows it as a test failure with the message
    (every failing rank's traceback) in full.
    """


def run_spawned(target: Callable[..., Any], world_size: int, out_dir: Path, *,
                args: tuple[Any, ...] = (), timeout: float, grace: float = 5.0,
                what: str) -> None:
    """Run ``target(rank, *args)`` in ``world_size`` fresh ``spawn``-ed processes.

    ``target`` and ``args`` are pickled (a module-level function of an importable
    module; the children get the parent's ``sys.path``); results travel through files the
    target writes under ``out_dir``. A child that raises leaves its traceback in
    ``out_dir/rank<r>.err`` and exits 1; the others then get ``grace`` seconds to finish
    or fail on their own, and whatever is left is killed, as is everything still running
    after ``timeout``. Raises :class:`RankError`, headed by ``what``, with every failing
    rank's traceback if any rank raised, died or was killed; no child outlives the call.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_spawned_rank, args=(rank, target, str(out_dir), args),
                             name=f"rank{rank}")
             for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    reason = ""
    killed: list[int] = []
    try:
        for proc in procs:
            proc.start()
        pending = list(procs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = reason or f"timed out after {timeout:.0f} s"
                break
            wait_for_sentinels([p.sentinel for p in pending], timeout=left)
            pending = [p for p in pending if p.exitcode is None]
            if not reason and any(p.exitcode not in (None, 0) for p in procs):
                reason = "a rank failed"
                # Let the others fail (or finish) on their own so their tracebacks show.
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        for rank, proc in enumerate(procs):
            if proc.pid is not None and proc.exitcode is None:
                killed.append(rank)
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(10.0)
    exitcodes = [proc.exitcode for proc in procs]
    if reason or any(code != 0 for code in exitcodes):
        raise RankError(f"{what}: {reason or 'a rank failed'}\n"
                        f"{_spawn_errors(out_dir, exitcodes, killed)}")


def _spawned_rank(rank: int, target: Callable[..., Any], out_dir: str,
                  args: tuple[Any, ...]) -> None:
    """Body of one spawned rank: run ``target``, leave a traceback if it raises, exit.

    The process ends with ``os._exit`` once its outcome is on disk: a full interpreter
    shutdown (of a torch process, say) takes seconds on a loaded machine and adds nothing.
    """
    code = 1
    try:
        target(rank, *args)
        code = 0
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _spawn_errors(out_dir: Path, exitcodes: Sequence[int | None], killed: Sequence[int]) -> str:
    """Describe every rank that did not succeed, with its traceback when it left one."""
    parts = []
    for rank, code in enumerate(exitcodes):
        err = out_dir / f"rank{rank}.err"
        if err.exists():
            parts.append(f"--- rank {rank} (exit code {code}) raised:\n{err.read_text()}")
        elif rank in killed:
            parts.append(f"--- rank {rank} was still running and was killed")
        elif code != 0:
            parts.append(f"--- rank {rank} died with exit code {code} (no traceback)")
    return "\n".join(parts)
