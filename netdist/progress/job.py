"""``Job``: one rank of a TCP job, driven from ordinary synchronous code.

::

    import netdist

    with netdist.connect() as job:                 # reads NETDIST_* / RANK / ... like init()
        job.group.all_reduce(grads, op="mean")     # blocks until done
        work = job.group.all_gather(shard, async_op=True)
        loss = model_step()                        # overlaps with the all-gather
        full = work.wait()

The transport, its heartbeats and every collective run on the job's ``ProgressThread``,
so a rank that computes for minutes between two collectives stays connected and alive.
The objects netdist builds on a transport (``PSClient``, ``FSDP``, aggregators,
``AsyncCheckpointer``) are made on that thread with ``job.make(cls, ...)`` and driven
through the same blocking proxy; ``job.run(coro)`` runs any coroutine there.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from netdist.collectives.group import Group
from netdist.config import DistributedConfig
from netdist.errors import NetdistError
from netdist.progress.handle import Handle
from netdist.progress.loops import LoopFactory
from netdist.progress.proxy import Awaiting, Blocking, unwrap, unwrap_arguments
from netdist.progress.thread import ProgressThread
from netdist.trace.signals import install_dump_signal
from netdist.transport.bootstrap import cut_for_user
from netdist.transport.rendezvous import OnCoordinatorReady
from netdist.transport.tcp import TcpTransport

__all__ = ["Job", "connect"]

T = TypeVar("T")


class Job:
    """A connected rank whose transport lives on a progress thread; see the module docstring.

    Build one with ``Job.connect()`` (or ``netdist.connect()``); close it with ``close()``
    or a ``with`` block, which closes the transport (BYE to every peer) and stops and
    joins the thread.
    """

    def __init__(self, progress: ProgressThread, transport: TcpTransport,
                 group: Group) -> None:
        """Use ``Job.connect()``; this only assembles the parts."""
        self.progress = progress
        self.config: DistributedConfig = transport.config
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.transport: Blocking = Blocking(transport, progress)
        """The ``TcpTransport`` (send / recv / barrier), blocking."""
        self.group: Blocking = Blocking(group, progress)
        """The world ``Group``: every collective, blocking (``async_op=True``: a Handle)."""
        self._closed = False
        atexit.register(self.close)  # a job left open still says BYE at exit

    @classmethod
    def connect(cls, config: DistributedConfig | None = None, *,
                loop_factory: LoopFactory | None = None,
                on_coordinator_ready: OnCoordinatorReady | None = None,
                **overrides: Any) -> Job:
        """Start a progress thread, join the job on it and return the connected ``Job``.

        ``config`` and ``overrides`` mean what they mean for ``netdist.init()``. Joining is
        bounded by the configuration's timeouts (``join_timeout``); on failure the thread
        is stopped and the same ``netdist.errors`` exception ``init()`` raises is raised
        here, its traceback cut to the caller's frames unless ``NETDIST_DEBUG=1``
        (``netdist.transport.bootstrap.cut_for_user``). Rank 0 calls
        ``on_coordinator_ready((host, port))`` (on the progress thread) once its
        coordinator is bound, which is how a coordinator port 0 is shared.
        """
        try:
            return cls._connect(config, loop_factory, on_coordinator_ready, overrides)
        except NetdistError as exc:
            cut_for_user(exc)
            raise  # a bare re-raise: this frame stays out of the traceback

    @classmethod
    def _connect(cls, config: DistributedConfig | None, loop_factory: LoopFactory | None,
                 on_coordinator_ready: OnCoordinatorReady | None,
                 overrides: dict[str, Any]) -> Job:
        """``connect`` with its errors as raised."""
        if config is None:
            config = DistributedConfig.from_env(None, **overrides)
        elif overrides:
            config = config.replace(**overrides)
        progress = ProgressThread(name=f"netdist-progress-rank{config.rank}",
                                  loop_factory=loop_factory).start()
        try:
            transport, group = progress.run(_join(config, on_coordinator_ready))
        except BaseException:
            progress.close()
            raise
        # the transport was made on the progress thread; signal handlers are set from the
        # caller's (usually the main) thread, so SIGUSR1 dumps this rank's flight recorder
        install_dump_signal(transport.recorder)
        return cls(progress, transport, group)

    # -- driving objects on the progress thread ------------------------------------------

    def make(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Build ``factory(*args, **kwargs)`` on the progress thread and return it blocking.

        Proxies among the arguments (``job.group``, ``job.transport``) are unwrapped; a
        factory that returns a coroutine (an ``async`` factory) is awaited there.
        """
        args, kwargs = unwrap_arguments(args, kwargs)

        async def build() -> Any:
            made = factory(*args, **kwargs)
            if isinstance(made, Coroutine):
                made = await made
            return made

        return self.blocking(self.progress.run(build()))

    def blocking(self, obj: Any) -> Blocking:
        """A blocking proxy for ``obj`` (an object or module with coroutine methods)."""
        return Blocking(obj, self.progress)

    def awaiting(self, obj: Any) -> Awaiting:
        """An asyncio proxy for ``obj`` whose operations run on the progress thread."""
        return Awaiting(obj, self.progress)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the progress thread and return its result."""
        return self.progress.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T], op: str = "operation") -> Handle[T]:
        """Start ``coro`` on the progress thread; returns a ``Handle`` at once."""
        return Handle(self.progress.submit(coro), op, self.progress)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, error: BaseException | None = None) -> None:
        """Close the group and the transport, then stop and join the thread.

        Without ``error`` every peer gets a BYE; with it (leaving a ``with`` block on an
        exception) the transport aborts, so peers are told which rank to blame
        (``Transport.abort``). Idempotent; safe after errors.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self.progress.running:
                self.progress.run(_leave(unwrap(self.group), unwrap(self.transport), error))
        finally:
            self.progress.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(exc)

    def __repr__(self) -> str:
        return (f"<Job rank {self.rank} of {self.world_size}"
                f"{' closed' if self._closed else ''}>")


def connect(config: DistributedConfig | None = None, **overrides: Any) -> Job:
    """``Job.connect()``: join a job from synchronous code (see ``netdist.progress.job``).

    A joining error is raised from the caller's line, its traceback cut to the caller's
    frames unless ``NETDIST_DEBUG=1``, as ``Job.connect`` does.
    """
    try:
        return Job.connect(config, **overrides)
    except NetdistError as exc:
        cut_for_user(exc)
        raise  # a bare re-raise: this frame stays out of the traceback


async def _join(config: DistributedConfig, on_coordinator_ready: OnCoordinatorReady | None
                ) -> tuple[TcpTransport, Group]:
    transport = await TcpTransport.connect(config, on_coordinator_ready=on_coordinator_ready)
    return transport, Group(transport)


async def _leave(group: Group, transport: TcpTransport, error: BaseException | None) -> None:
    try:
        await group.aclose()
    finally:
        if error is None:
            await transport.aclose()
        else:
            await transport.abort(error)
