"""Synchronous parameter server with rank 0 as the server (the seeds' API).

``ParameterServer(group)`` is a star-topology gradient aggregator: every rank -- the
server rank included, which trains like any other rank -- calls ``reduce_gradients`` with
its gradients and gets the average back, bit-identical on every rank.

One round, for ``n`` ranks and root ``r``:

1. every worker cuts its gradients into pieces (``plan_pieces``): large tensors into
   chunks of at most ``chunk_bytes`` sent straight from the tensor's memory, runs of
   small tensors packed into one message, so many small tensors never mean many round
   trips; each piece has its own tag;
2. the server posts one receive per (worker, piece) up front, straight into a
   per-worker buffer (zero-copy), so all workers stream concurrently;
3. the server sums each piece in a fixed order -- its own gradient first, then the
   workers in ascending rank (rank order for the default root 0) -- as soon as the next
   contribution in that order has arrived, divides by ``n`` and immediately sends the
   averaged piece to every worker while later pieces are still arriving; workers
   receive large pieces straight into the result tensors.

The fixed order makes the result reproducible and independent of arrival timing; every
rank receives the very bytes the server computed. Training with ``n`` ranks of batch
``b`` therefore matches single-process training with batch ``n*b`` up to the rounding of
a mean of means (about 1e-16 relative per step). bfloat16 gradients are summed as torch
sums them (each pairwise step in float32, rounded back to bfloat16; the mean divided in
float32 and rounded once), so the average is torch's ``((g0 + g1) + g2) / 3`` bit for bit.

Torch tensors: parameters and gradients may be CPU torch tensors wherever arrays are
accepted, read and written through NumPy views of their memory (``netdist.tensors``;
nothing is copied). ``reduce_gradients`` returns a tensor for every gradient given as a
tensor; ``broadcast_params`` writes into the given tensors, and a non-contiguous one on a
worker is filled through a contiguous copy that is copied back. A tensor off the CPU
raises ``ValueError`` naming its device before anything is sent.

Failures end the round on every rank: a lost worker makes the server raise
``ParameterServerError`` naming it (a silent one: ``NetdistTimeoutError``) and send that
text to every other worker, which raise ``ParameterServerError``; a lost server makes every worker raise ``ParameterServerError`` naming the server
rank. Nothing waits longer than the timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgpack
import numpy as np

from netdist.errors import (
    NetdistError,
    NetdistTimeoutError,
    ParameterServerError,
    PeerLostError,
)
from netdist.collectives.tags import TagRange
from netdist.ps._link import Endpoint, GroupLike, RankFailure, first_error, reserve_ps_tags, run_all
from netdist.ps.protocol import SYNC_OWNER, SyncStream, stream_tag
from netdist.ps.messages import FlatLayout, Piece, plan_pieces
from netdist.tensors import StagedOut, as_array, is_tensor, stage_out, to_tensor
from netdist.transport.base import Transport
from netdist.reduce_kernels import combine, divide_into
from netdist.types import ReduceOp, dtype_from_wire, is_bfloat16

__all__ = ["ParameterServer", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Largest piece of a round: large enough to amortise per-message cost, small enough that
the server's summing and sending overlap the arrival of later pieces."""

_NOTIFY_TIMEOUT = 5.0
"""Bound on delivering a failure notice to a worker (best effort)."""


@dataclass(slots=True)
class _Prepared:
    """Per-layout state: the pieces, reusable packing buffers, announcement status."""

    layout: FlatLayout
    pieces: tuple[Piece, ...]
    worker_buffers: dict[int, list[np.ndarray]] = field(default_factory=dict)
    """Server: per worker, one receive buffer per piece (allocated once)."""
    send_scratch: dict[int, np.ndarray] = field(default_factory=dict)
    """Per piece index: where pieces that cannot go straight from memory are packed."""
    recv_scratch: dict[int, np.ndarray] = field(default_factory=dict)
    """Per piece index: where packed incoming pieces land before being unpacked."""
    announced: bool = False

    @staticmethod
    def _buffer(cache: dict[int, np.ndarray], piece: Piece) -> np.ndarray:
        buf = cache.get(piece.index)
        if buf is None:
            buf = cache[piece.index] = np.empty(piece.size, dtype_from_wire(piece.dtype))
        return buf

    def outgoing(self, piece: Piece, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The piece's data from ``arrays``: their own memory when possible, else packed."""
        view = piece.view(arrays)
        return view if view is not None else piece.pack(arrays,
                                                         self._buffer(self.send_scratch, piece))

    def landing(self, piece: Piece, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Where an incoming piece for ``arrays`` (C-contiguous) should land."""
        view = piece.view(arrays)
        return view if view is not None else self._buffer(self.recv_scratch, piece)


class ParameterServer:
    """Star-topology averaging of gradients through one server rank (default rank 0).

    ``group`` is a ``netdist.collectives.Group`` or a ``Transport`` (the whole world).
    Every rank of the group constructs one and calls the same methods in the same order.
    The server rank also trains: its gradients count like everyone else's.

    ``timeout`` bounds every wait of a round (default: the group's/transport's).
    ``tags``: the transport tags to talk on; by default the server reserves the next
    range of its group (``Group.reserve_tags``), so a second ``ParameterServer`` on the
    same ranks gets its own without being told, provided every rank builds them in the
    same order.
    """

    def __init__(self, group: GroupLike | Transport, *, root: int = 0,
                 timeout: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 tags: TagRange | None = None) -> None:
        self._ep = Endpoint(group, timeout)
        if not 0 <= root < self._ep.world_size:
            raise ValueError(f"root {root} is outside 0..{self._ep.world_size - 1}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.root = root
        self.chunk_bytes = int(chunk_bytes)
        self.tags = reserve_ps_tags(group, SYNC_OWNER, tags)
        """The transport tags this server talks on (reserved from the group)."""
        self._workers = [r for r in range(self._ep.world_size) if r != root]
        self._prepared: dict[Any, _Prepared] = {}
        self._closed = False
        self._lock = asyncio.Lock()
        self.bytes_sent = 0
        """Payload bytes this rank has put on the wire (the server sends n-1 copies)."""

    # -- properties ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._ep.rank

    @property
    def world_size(self) -> int:
        return self._ep.world_size

    @property
    def is_server(self) -> bool:
        return self._ep.rank == self.root

    @property
    def timeout(self) -> float:
        return self._ep.timeout

    # -- public API --------------------------------------------------------------------

    async def broadcast_params(self, params: Sequence[Any], *,
                               timeout: float | None = None) -> list[Any]:
        """Make every rank's ``params`` equal to the server's, in place; returns ``params``.

        Arrays must be C-contiguous and writable on the workers. Any wire dtype works.
        CPU torch tensors work too (see the module docstring): a non-contiguous tensor on
        a worker is filled through a contiguous copy that is copied back.
        """
        if isinstance(params, np.ndarray) or is_tensor(params):
            raise TypeError("broadcast_params needs a list of parameters, got a single "
                            f"{type(params).__name__}")
        params = list(params)
        staged: list[StagedOut | None] = [None] * len(params)
        arrays: list[np.ndarray] = []
        for index, p in enumerate(params):
            if isinstance(p, np.ndarray):
                if not self.is_server and (not p.flags.c_contiguous or not p.flags.writeable):
                    raise ValueError(f"parameter {index} must be C-contiguous and writable to "
                                     "receive the server's values in place")
                arrays.append(p)
            elif not is_tensor(p):
                raise TypeError(f"parameter {index} must be a numpy.ndarray or a CPU "
                                f"torch.Tensor, got {type(p).__name__}")
            elif self.is_server:
                arrays.append(as_array(p, f"broadcast_params: parameter {index}"))
            else:
                staged[index] = stage_out(p, f"broadcast_params: parameter {index}")
                arrays.append(staged[index].array)  # type: ignore[union-attr]
        async with self._round("broadcast_params"):
            if self.world_size == 1:
                return params
            prep = self._prepare(arrays)
            t = self._ep.timeout if timeout is None else timeout
            with self._ep.transport.recorder.span(
                    "ps", "broadcast_params", role="server" if self.is_server else "worker",
                    bytes=sum(a.nbytes for a in arrays)):
                if self.is_server:
                    await self._serve(prep, t, self._broadcast_pieces(prep, arrays, t))
                else:
                    await self._as_worker(prep, t, "broadcast_params",
                                          self._recv_pieces(prep, arrays, SyncStream.PARAMS,
                                                            t))
            for stage in staged:
                if stage is not None:
                    stage.finish()
            return params

    async def reduce_gradients(self, grads: Sequence[Any], *,
                               timeout: float | None = None) -> list[Any]:
        """Average ``grads`` over all ranks; every rank gets the same new arrays.

        Returns fresh arrays shaped like ``grads`` (which are not modified); a gradient
        given as a CPU torch tensor comes back as a tensor (over the fresh result).
        Gradients must be floating point. bfloat16 is summed as torch sums it: each
        pairwise step in float32, rounded back to bfloat16 (``netdist.types``).
        """
        if isinstance(grads, np.ndarray) or is_tensor(grads):
            raise TypeError("reduce_gradients needs a list of gradients, got a single "
                            f"{type(grads).__name__}")
        given = list(grads)
        grads = [g if isinstance(g, np.ndarray) else as_array(g, f"reduce_gradients: "
                                                                f"gradient {i}")
                 for i, g in enumerate(given)]
        async with self._round("reduce_gradients"):
            prep = self._prepare(grads)
            for group, name in enumerate(prep.layout.group_dtypes):
                dtype = prep.layout.group_dtype(group)
                if dtype.kind != "f" and not is_bfloat16(dtype):
                    raise TypeError(f"gradients must be floating point, got {name}")
            result = [np.empty(shape, dtype_from_wire(dtype))
                      for shape, dtype in zip(prep.layout.shapes, prep.layout.dtypes)]
            if self.world_size > 1:
                t = self._ep.timeout if timeout is None else timeout
                with self._ep.transport.recorder.span(
                        "ps", "reduce_gradients", role="server" if self.is_server else "worker",
                        bytes=sum(g.nbytes for g in grads)):
                    if self.is_server:
                        await self._serve(prep, t, self._reduce_pieces(prep, grads, result, t))
                    else:
                        async def exchange() -> None:
                            await run_all([self._recv_pieces(prep, result, SyncStream.AVG, t),
                                           self._send_pieces(prep, grads, t)])

                        await self._as_worker(prep, t, "reduce_gradients", exchange())
            else:
                for out, g in zip(result, grads):
                    np.copyto(out, g)
            return [r if isinstance(g, np.ndarray) else to_tensor(r)
                    for r, g in zip(result, given)]

    async def aggregate(self, grads: Sequence[Any]) -> list[Any]:
        """``GradientAggregator`` interface: the averaged gradients (``reduce_gradients``)."""
        return await self.reduce_gradients(grads)

    async def aclose(self) -> None:
        """Forget cached buffers; the transport stays open (the caller owns it). Idempotent."""
        self._closed = True
        self._prepared.clear()

    async def __aenter__(self) -> ParameterServer:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # -- plumbing ----------------------------------------------------------------------

    def _round(self, what: str) -> asyncio.Lock:
        if self._closed:
            raise ParameterServerError(f"{what} on a closed ParameterServer")
        if self._lock.locked():
            raise ParameterServerError(
                f"{what} called while another round of this ParameterServer is running; "
                "rounds must be issued one at a time, in the same order on every rank")
        return self._lock

    def _prepare(self, arrays: Sequence[np.ndarray]) -> _Prepared:
        layout = FlatLayout.from_arrays(arrays)
        key = (layout.shapes, layout.dtypes)
        prep = self._prepared.get(key)
        if prep is None:
            prep = self._prepared[key] = _Prepared(layout, plan_pieces(layout, self.chunk_bytes))
        return prep

    def _tag(self, stream: SyncStream, index: int = 0) -> int:
        return stream_tag(self.tags, stream, index)

    async def _recv_from(self, worker: int, tag: int, out: np.ndarray | None,
                         timeout: float, what: str) -> np.ndarray:
        try:
            return await self._ep.recv(worker, tag, out=out, timeout=timeout)
        except NetdistError as exc:
            raise RankFailure(worker, what, exc) from exc

    async def _send_to(self, worker: int, data: np.ndarray, tag: int, timeout: float,
                       what: str) -> None:
        self.bytes_sent += data.nbytes
        try:
            await self._ep.send(worker, data, tag, timeout=timeout)
        except NetdistError as exc:
            raise RankFailure(worker, what, exc) from exc

    # server side -------------------------------------------------------------------------

    async def _serve(self, prep: _Prepared, timeout: float, body: Any) -> None:
        """Run one server round; on failure tell every other worker, then raise."""
        try:
            if not prep.announced:
                await self._check_layouts(prep, timeout)
            await body
        except RankFailure as failure:
            error = failure.error
            if isinstance(error, PeerLostError):
                # lead with the rank that went away first, not with the server that saw it
                told = "" if error.via is None else f" (reported by rank {error.rank})"
                message = (f"{error.origin_reason}{told} — the parameter server (rank "
                           f"{self.root}) lost worker rank {failure.rank} while "
                           f"{failure.what}")
            else:
                message = (f"parameter server (rank {self.root}) failed in round with worker "
                           f"rank {failure.rank}: {failure.what}: {self._ep.describe(error)}")
            await self._notify(message, skip=failure.rank if isinstance(
                failure.error, PeerLostError) else None)
            if isinstance(failure.error, NetdistTimeoutError):
                raise NetdistTimeoutError(message) from failure.error
            raise ParameterServerError(message) from failure.error
        except ParameterServerError as exc:
            await self._notify(str(exc), skip=None)
            raise
        finally:
            body.close()  # no-op once it ran; avoids "never awaited" if it did not

    async def _check_layouts(self, prep: _Prepared, timeout: float) -> None:
        mine = prep.layout.signature()
        tag = self._tag(SyncStream.LAYOUT)
        received = await run_all([self._recv_from(w, tag, None, timeout, "receiving its "
                                                  "tensor layout") for w in self._workers])
        for worker, raw in zip(self._workers, received):
            try:
                theirs = msgpack.unpackb(raw.tobytes())
            except (ValueError, msgpack.UnpackException) as exc:
                raise ParameterServerError(f"rank {worker} sent an unreadable tensor "
                                           f"layout: {exc}") from None
            if theirs != mine:
                raise ParameterServerError(
                    f"rank {worker} passed tensors {_describe(theirs)} but the parameter "
                    f"server (rank {self.root}) has {_describe(mine)}; every rank must pass "
                    "the same shapes and dtypes in the same order")
        prep.announced = True

    async def _notify(self, message: str, skip: int | None) -> None:
        data = np.frombuffer(message.encode(), dtype=np.uint8)
        tag = self._tag(SyncStream.ERROR)

        async def one(worker: int) -> None:
            try:
                await self._ep.send(worker, data, tag, timeout=min(_NOTIFY_TIMEOUT,
                                                                  self._ep.timeout))
            except NetdistError:
                pass  # that worker is unreachable; it sees its own transport error

        await asyncio.gather(*(one(w) for w in self._workers if w != skip))

    async def _reduce_pieces(self, prep: _Prepared, grads: list[np.ndarray],
                             result: list[np.ndarray], timeout: float) -> None:
        """Sum piece by piece in fixed order as contributions arrive; send each average.

        Order per element: the server's own gradient, then the workers in ascending rank.
        """
        buffers = self._worker_buffers(prep)
        n = self.world_size
        try:
            async with asyncio.TaskGroup() as tg:
                pending = {}
                for piece in prep.pieces:
                    tag = self._tag(SyncStream.GRAD, piece.index)
                    for w in self._workers:
                        pending[w, piece.index] = tg.create_task(self._recv_from(
                            w, tag, buffers[w][piece.index], timeout,
                            f"receiving gradient piece {piece.index}"))
                for piece in prep.pieces:
                    own = prep.outgoing(piece, grads)
                    direct = piece.view(result)
                    acc = direct if direct is not None else np.empty_like(own)
                    for i, w in enumerate(self._workers):
                        await pending[w, piece.index]
                        combine(ReduceOp.SUM, own if i == 0 else acc, buffers[w][piece.index],
                                acc)
                    divide_into(acc, n)
                    if direct is None:
                        piece.unpack(acc, result)
                    tag = self._tag(SyncStream.AVG, piece.index)
                    for w in self._workers:
                        tg.create_task(self._send_to(w, acc, tag, timeout,
                                                     f"sending averaged piece {piece.index}"))
        except BaseExceptionGroup as group:
            raise first_error(group) from None

    async def _broadcast_pieces(self, prep: _Prepared, params: list[np.ndarray],
                                timeout: float) -> None:
        for piece in prep.pieces:
            data = prep.outgoing(piece, params)
            tag = self._tag(SyncStream.PARAMS, piece.index)
            await run_all([self._send_to(w, data, tag, timeout,
                                         f"sending parameter piece {piece.index}")
                           for w in self._workers])

    def _worker_buffers(self, prep: _Prepared) -> dict[int, list[np.ndarray]]:
        if not prep.worker_buffers:
            prep.worker_buffers = {
                w: [np.empty(p.size, dtype_from_wire(p.dtype)) for p in prep.pieces]
                for w in self._workers}
        return prep.worker_buffers

    # worker side -------------------------------------------------------------------------

    async def _as_worker(self, prep: _Prepared, timeout: float, what: str, body: Any) -> None:
        """Run one worker round, racing it against a failure notice from the server."""
        root = self.root

        async def main() -> None:
            if not prep.announced:
                raw = msgpack.packb(prep.layout.signature())
                self.bytes_sent += len(raw)
                await self._ep.send(root, np.frombuffer(raw, dtype=np.uint8),
                                    self._tag(SyncStream.LAYOUT), timeout=timeout)
                prep.announced = True
            await body

        main_task = asyncio.ensure_future(main())
        watch = asyncio.ensure_future(
            self._ep.recv(root, self._tag(SyncStream.ERROR), timeout=timeout + 1.0))
        try:
            await asyncio.wait({main_task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not watch.cancelled() and watch.exception() is None:
                text = watch.result().tobytes().decode(errors="replace")
                raise ParameterServerError(f"{what} on rank {self.rank}: {text}")
            try:
                await main_task
            except PeerLostError as exc:
                # the server may have said why before it went away: prefer its words
                await asyncio.wait({watch}, timeout=0.05)
                if watch.done() and not watch.cancelled() and watch.exception() is None:
                    text = watch.result().tobytes().decode(errors="replace")
                    raise ParameterServerError(f"{what} on rank {self.rank}: {text}") from exc
                if exc.via is not None:  # the server aborted because it lost someone
                    raise ParameterServerError(
                        f"{what} on rank {self.rank}: {self._ep.describe(exc)} (rank {root} "
                        "is the parameter server)") from exc
                raise ParameterServerError(
                    f"{what} on rank {self.rank}: lost the parameter server (rank {root}): "
                    f"{self._ep.describe(exc)}") from exc
        finally:
            for task in (main_task, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(main_task, watch, return_exceptions=True)
            body.close()

    async def _recv_pieces(self, prep: _Prepared, arrays: list[np.ndarray],
                           stream: SyncStream, timeout: float) -> None:
        """Receive every piece into ``arrays`` (C-contiguous): direct ones in place."""
        landings = [prep.landing(piece, arrays) for piece in prep.pieces]
        await run_all([self._ep.recv(self.root, self._tag(stream, piece.index), out=out,
                                     timeout=timeout)
                       for piece, out in zip(prep.pieces, landings)])
        for piece, out in zip(prep.pieces, landings):
            if piece.view(arrays) is None:
                piece.unpack(out, arrays)

    async def _send_pieces(self, prep: _Prepared, grads: list[np.ndarray],
                           timeout: float) -> None:
        for piece in prep.pieces:
            data = prep.outgoing(piece, grads)
            self.bytes_sent += data.nbytes
            await self._ep.send(self.root, data, self._tag(SyncStream.GRAD, piece.index),
                                timeout=timeout)


def _describe(signature: Any) -> str:
    try:
        shapes, dtypes = signature
        return "[" + ", ".join(f"{d}{list(s)}" for s, d in zip(shapes, dtypes)) + "]"
    except (TypeError, ValueError):
        return repr(signature)
