"""The transport contract every layer above is written against.

A ``Transport`` moves bytes and NumPy arrays between the ranks of one job:

- messages between a pair of ranks on one tag arrive in the order sent; different tags
  are independent, so several collectives may be in flight at once;
- ``recv(..., out=arr)`` lands the payload directly in ``arr``; a message that arrives
  before its ``recv`` is posted is held and copied once;
- every wait is bounded: a timeout raises ``NetdistTimeoutError`` naming the operation,
  peer, tag and elapsed time; a lost peer fails every pending and later operation on it
  with ``PeerLostError``;
- ``aclose()`` is idempotent and completes even when the caller is cancelled.

Tags are non-negative integers below ``MAX_TAG``. Small tags are free for applications;
collectives allocate theirs from a per-group counter (see ``netdist.collectives``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.errors import TransportClosedError
from netdist.trace.recorder import Recorder
from netdist.transport.traffic import PeerTraffic, Traffic

if TYPE_CHECKING:
    import asyncio

__all__ = ["Transport", "MAX_TAG", "as_payload_array"]

MAX_TAG = 2**63 - 1

logger = logging.getLogger("netdist.trace")


def as_payload_array(data: Any) -> np.ndarray:
    """View ``data`` (bytes-like or array) as a C-contiguous little-endian array.

    Bytes-like objects become ``uint8`` arrays without a copy. Big-endian or
    non-contiguous arrays are normalised with an explicit copy, because the wire carries
    raw little-endian C-order bytes.
    """
    if isinstance(data, np.ndarray):
        array = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        array = np.frombuffer(data, dtype=np.uint8)
    else:
        try:
            array = np.asarray(data)
        except Exception as exc:  # pragma: no cover - exotic objects
            raise TypeError(f"cannot send object of type {type(data).__name__}") from exc
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"), order="C")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


class Transport(abc.ABC):
    """Point-to-point messaging plus a barrier among ``world_size`` ranks."""

    rank: int
    world_size: int
    timeout: float
    """Default bound, in seconds, of every wait whose caller gives none (a ``Group``
    made without ``timeout=`` uses it for its collectives)."""

    @abc.abstractmethod
    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        """Send ``data`` (bytes-like or ndarray) to rank ``dst`` on ``tag``.

        Returns once ``data``'s memory may be reused by the caller. On timeout or
        cancellation the connection to ``dst`` may have carried a partial frame and is
        failed, so the peer sees ``PeerLostError`` rather than corrupt data.
        """

    @abc.abstractmethod
    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        """Receive the next message from ``src`` on ``tag``.

        With ``out`` the payload lands in ``out`` (same byte size required; the element
        type of ``out`` wins) and ``out`` is returned. Without it a new array with the
        sender's dtype and shape is returned. On timeout or cancellation the posted
        receive is withdrawn; a message that arrives later is kept for the next ``recv``.

        bfloat16 comes back as ``netdist.types.BFLOAT16``: a real ``ml_dtypes.bfloat16``
        array where ``ml_dtypes`` is installed, else ``BFLOAT16_RAW``, the raw bits in a
        structured dtype NumPy refuses to compute with (so they are never misread as
        numbers). The transport does not raise for it, because the layers built on it
        (gather, pipeline stages, ``Group.recv`` itself) need exactly those bits; callers
        wanting a usable value without ``ml_dtypes`` receive through ``Group.recv``, which
        gives a ``torch.bfloat16`` tensor where torch is imported and otherwise raises a
        ``TypeError`` naming the dtype and ``pip install 'netdist[bf16]'``
        (``netdist.tensors.numpy_result``), or pass ``out=``.
        """

    @abc.abstractmethod
    async def barrier(self, *, timeout: float | None = None) -> None:
        """Wait until every rank has entered the barrier (dissemination, log2 n rounds)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every connection and fail pending operations. Idempotent."""

    async def abort(self, error: BaseException | str) -> None:
        """Close because this rank is failing with ``error`` (an exception or a reason).

        Transports that can tell their peers why (TCP: an ERROR frame naming the rank
        that went away first) do so; the default simply closes. Idempotent with
        ``aclose``; ``async with`` calls it when the block exits on an exception.
        """
        await self.aclose()

    @property
    def closed(self) -> bool:
        """True once ``aclose`` has started."""
        return False

    def check_peer(self, peer: int, what: str = "peer") -> None:
        """Raise ``ValueError`` unless ``peer`` names another rank of this job."""
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
            raise TypeError(f"{what} must be an int rank, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what} {peer} is outside 0..{self.world_size - 1}")
        if peer == self.rank:
            raise ValueError(f"{what} {peer} is this rank; send/recv need another rank")

    def lost_peer_error(self, peer: int) -> Exception | None:
        """The error a receive from ``peer`` would raise right now because the transport
        already knows ``peer`` is gone (``PeerLostError``), else ``None``.

        Answered from what the transport knows, without waiting and without connecting:
        a ``Group`` names the lost members in its timeout messages from this. Transports
        that cannot tell return ``None`` (the default).
        """
        return None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this transport's connections live on, where its coroutines (and
        a ``Group``'s over it) must run; ``None`` for a transport bound to no loop (the
        default: ``InProcessTransport`` runs on whichever loop awaits it).

        Synchronous code on another thread hands such a coroutine over with
        ``asyncio.run_coroutine_threadsafe(coro, transport.loop)`` (the tensor-parallel
        layers do, ``netdist.parallel.tp_comm``).
        """
        return None

    @property
    def spin_seconds(self) -> float:
        """How long a wait for a small message may busy-poll before it sleeps (0: never);
        the TCP transport's ``SpinPolicy`` budget, which the shared-memory lane of small
        all-reduces uses too. Transports that never poll say 0 (the default)."""
        return 0.0

    def host_keys(self) -> tuple[bytes, ...] | None:
        """Every rank's host key (``netdist.transport.host_identity.host_key``) in rank
        order, as learnt when the job formed, or ``None`` if this transport does not know
        them (a ``Group`` then asks its members)."""
        return None

    def traffic(self) -> Traffic:
        """Bytes and messages exchanged with every peer so far, grouped by host too
        (``netdist.transport.traffic``); subtract two snapshots to measure a window.

        Transports that do not count (the default) report zeros for every peer.
        """
        zero = PeerTraffic()
        return Traffic(self.rank, {peer: zero for peer in range(self.world_size)
                                   if peer != self.rank}, self.host_keys())

    @property
    def recorder(self) -> Recorder:
        """This rank's flight recorder and trace (``netdist.trace``), made on first use:
        every ``Group`` over this transport records its calls there."""
        recorder: Recorder | None = self.__dict__.get("_recorder")
        if recorder is None:
            recorder = self._recorder = self._new_recorder()
        return recorder

    def _new_recorder(self) -> Recorder:
        """A recorder for this rank, tracing from the start under ``NETDIST_TRACE``."""
        recorder = Recorder(self.rank, self.world_size, self._job_name())
        recorder.peer_status = self._lost_peer_reasons
        if recorder.settings.trace_dir is not None:
            recorder.start_trace()
        return recorder

    def _job_name(self) -> str:
        """The job id recorders name in their files (transports with a config say it)."""
        return "netdist"

    def _lost_peer_reasons(self) -> dict[int, str]:
        """Every peer this transport knows is gone, with why (for flight records)."""
        reasons = {}
        for peer in range(self.world_size):
            if peer != self.rank:
                error = self.lost_peer_error(peer)
                if error is not None:
                    reasons[peer] = str(error)
        return reasons

    def _finish_recording(self) -> None:
        """At close: write the trace if one is running (a failure to write is logged)."""
        recorder: Recorder | None = self.__dict__.get("_recorder")
        if recorder is not None and recorder.trace is not None:
            try:
                recorder.stop_trace()
            except OSError as exc:
                logger.warning(
                    "netdist: rank %d could not write its trace: %s", self.rank, exc)

    async def find_lost_peers(self, peers: Sequence[int], *,
                              timeout: float) -> dict[int, Exception]:
        """Which of ``peers`` are gone, each with the error a receive from it would raise.

        Peers the transport already knows are gone are answered at once. A transport that
        connects on first use also tries, for at most ``timeout`` seconds, to reach the
        listed peers it has never talked to, so a rank that left is found even by ranks
        it never exchanged a message with. The default answers from ``lost_peer_error``.
        """
        found = {}
        for peer in peers:
            error = self.lost_peer_error(peer)
            if error is not None:
                found[peer] = error
        return found

    def check_open(self, op: str) -> None:
        """Raise ``TransportClosedError`` naming ``op`` once the transport is closed."""
        if self.closed:
            raise TransportClosedError(f"{op} on rank {self.rank}: transport is closed")

    @staticmethod
    def check_tag(tag: int) -> int:
        """Return ``tag`` as an int; ``ValueError`` unless it is an int in 0..MAX_TAG."""
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) \
                or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag must be an int in 0..2**63-1, got {tag!r}")
        return int(tag)

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            await self.aclose()
        else:
            await self.abort(exc)
