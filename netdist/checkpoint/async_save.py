"""Asynchronous checkpointing: copy now, write in the background.

``AsyncCheckpointer(dir, rank, world_size, shard_spec).save_async(state)`` copies (stages)
every array into staging buffers before it returns - after that the caller may keep
training and mutate its arrays - and writes the staged copy in a worker thread with the
same crash-safe protocol as :func:`save_distributed`, while the event loop keeps running.

``state`` is anything :func:`save_distributed` takes, through the same code
(``prepare_share`` now, ``write_share`` in the writer thread: the one save path of
:mod:`netdist.checkpoint.writing` with the per-rank API's coordination): a flat mapping
of arrays, or nested training state - a model's and an optimizer's ``state_dict()``, the
module, optimizer, LR scheduler or :class:`~netdist.checkpoint.RNGState` itself, dicts
and lists of tensors and plain values. It is taken as it is at the call:
``state_dict()`` is called, plain values (step counters, ``param_groups``, RNG states)
are encoded and every tensor is copied before ``save_async`` returns, so an
``optimizer.step()`` that updates parameters in place right after does not leak into the
saved step. Tied tensors are staged and written once, partly overlapping ones as one
region (:mod:`netdist.checkpoint.views`); :func:`load_distributed` with ``like=``
restores the tree.

- Staging buffers are allocated on the first save and reused by later ones (same names,
  shapes and dtypes), so steady-state saves do not page-fault fresh memory; the copy is
  split over ``staging_threads`` threads (NumPy releases the GIL while copying). The
  stall - how long ``save_async`` blocks its caller - is ``future.stall_seconds``.
- One save in flight at a time: a ``save_async`` call while the previous save is still
  writing **waits for it** (blocking the caller, counted in its stall) and then stages;
  the staging buffers hold the previous state until it is on disk. To overlap fully,
  ``await`` the previous future before the next save.
- A failed write is reported through the future (``await``, ``wait()`` and
  ``result()`` raise it; an OS error as ``CheckpointError`` naming the rank and the
  file); the next save proceeds normally. With ``step=N`` a failed or killed save
  leaves the previous checkpoint of every step loadable (staging and commit by rename,
  :mod:`netdist.checkpoint.commit`). Once the checkpoint is committed the future
  succeeds: a ``latest`` that could not be rewritten or an old checkpoint that could not
  be rotated away is reported in its ``SaveResult`` (``latest_updated``, ``warnings``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from netdist.checkpoint.api import PreparedShare, prepare_share, write_share
from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES, dtype_name
from netdist.checkpoint.metadata import ShardMetadata, TensorShardSpec
from netdist.checkpoint.writing import SaveResult, check_keep_last, check_rank
from netdist.errors import CheckpointError, NetdistTimeoutError

__all__ = ["AsyncCheckpointer", "CheckpointFuture"]

_MIN_SPLIT_BYTES = 1 << 20


class CheckpointFuture:
    """The outcome of one :meth:`AsyncCheckpointer.save_async` call.

    Awaitable (``await fut`` -> :class:`SaveResult`), with ``done()``/``is_done()`` and a
    blocking ``wait(timeout)``/``result(timeout)`` for synchronous code. Waiting or
    awaiting any number of times returns the same result (or raises the same error).
    """

    __slots__ = ("_future", "step", "stall_seconds")

    def __init__(self, future: concurrent.futures.Future[SaveResult], step: int | None,
                 stall_seconds: float) -> None:
        self._future = future
        self.step = step
        self.stall_seconds = stall_seconds
        """How long ``save_async`` blocked its caller (staging and validation)."""

    def done(self) -> bool:
        """True once the write finished, successfully or not."""
        return self._future.done()

    def is_done(self) -> bool:
        """Alias of :meth:`done`."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block until the save is durable and committed; return its result."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise NetdistTimeoutError(f"checkpoint save (step {self.step}) still running after "
                                      f"{timeout} s") from None

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Same as :meth:`result`; blocks the calling thread (in a coroutine, ``await``)."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise NetdistTimeoutError(f"checkpoint save (step {self.step}) still running after "
                                      f"{timeout} s") from None

    def add_done_callback(self, fn: Callable[[CheckpointFuture], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, SaveResult]:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<CheckpointFuture step={self.step} {state}>"


class AsyncCheckpointer:
    """Saves this rank's share in the background (see the module docstring).

    ``dir``, ``rank``, ``world_size`` and ``shard_spec`` mean what they mean for
    :func:`save_distributed`; ``keep_last`` rotates step checkpoints. Close it (``close()``,
    ``await aclose()`` or a ``with``/``async with`` block) to wait for the last save and
    stop the threads.
    """

    def __init__(self, dir: str | os.PathLike[str], rank: int, world_size: int,
                 shard_spec: ShardMetadata | Mapping[str, TensorShardSpec] | None = None, *,
                 keep_last: int | None = None, run_id: str | None = None,
                 staging_threads: int = 2) -> None:
        check_rank(rank, world_size)
        check_keep_last(keep_last)
        if staging_threads < 1:
            raise ValueError(f"staging_threads must be >= 1, got {staging_threads}")
        self.dir = Path(dir)
        self.rank = rank
        self.world_size = world_size
        self.shard_spec = shard_spec
        self.keep_last = keep_last
        self.run_id = run_id
        self._staging: dict[str, np.ndarray] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "netdist-ckpt-writer")
        self._stagers = (concurrent.futures.ThreadPoolExecutor(staging_threads - 1,
                                                               "netdist-ckpt-stage")
                         if staging_threads > 1 else None)
        self._threads = staging_threads
        self._inflight: CheckpointFuture | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- public
    @property
    def staging_bytes(self) -> int:
        """Bytes held in staging buffers (kept between saves for reuse)."""
        return sum(b.nbytes for b in self._staging.values())

    @property
    def in_flight(self) -> CheckpointFuture | None:
        """The save still being written, if any."""
        current = self._inflight
        return current if current is not None and not current.done() else None

    def save_async(self, state_dict: Any, *, step: int | None = None,
                   extra: Mapping[str, Any] | None = None) -> CheckpointFuture:
        """Snapshot ``state_dict`` now (module docstring), write it in the background;
        returns at once after the copy. Invalid input raises here, synchronously; write
        errors go to the future."""
        started = time.perf_counter()
        with self._lock:
            if self._closed:
                raise CheckpointError("save_async on a closed AsyncCheckpointer")
            previous = self._inflight
            if previous is not None:
                concurrent.futures.wait([previous._future])  # one save in flight at a time
            share = self._prepare(state_dict)
            staged = share.with_arrays(self._stage(share.arrays))
            future = self._writer.submit(
                write_share, staged, self.dir, self.rank, self.world_size,
                self.shard_spec, step=step, keep_last=self.keep_last, extra=extra,
                run_id=self.run_id, started=started)
            handle = CheckpointFuture(future, step, time.perf_counter() - started)
            self._inflight = handle
            return handle

    def reserve(self, state_dict: Any) -> int:
        """Allocate (and fault in) the staging buffers for ``state_dict`` ahead of time.

        Fresh memory is slow to touch the first time (page faults); calling this once at
        start-up, outside the training loop, makes the first ``save_async`` stall only
        for the copy. Returns the staging bytes held. Waits for a save in flight.
        """
        with self._lock:
            if self._closed:
                raise CheckpointError("reserve on a closed AsyncCheckpointer")
            previous = self._inflight
            if previous is not None:
                concurrent.futures.wait([previous._future])
            self._stage(self._prepare(state_dict).arrays)
            return self.staging_bytes

    def close(self) -> None:
        """Wait for the save in flight (blocking) and stop the worker threads. Idempotent."""
        with self._lock:
            self._closed = True
            current = self._inflight
        if current is not None:
            concurrent.futures.wait([current._future])
        self._writer.shutdown(wait=True)
        if self._stagers is not None:
            self._stagers.shutdown(wait=True)
        self._staging = {}

    async def aclose(self) -> None:
        """Like :meth:`close`, without blocking the event loop. Idempotent."""
        current = self._inflight
        if current is not None:
            await asyncio.wait([asyncio.wrap_future(current._future)])
        await asyncio.to_thread(self.close)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> AsyncCheckpointer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- staging
    def _prepare(self, state_dict: Any) -> PreparedShare:
        """Validate and flatten ``state_dict`` exactly as ``save_distributed`` does."""
        return prepare_share(state_dict, self.shard_spec, self.rank, self.world_size)

    def _stage(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        staged: dict[str, np.ndarray] = {}
        for name, array in arrays.items():
            dtype = CHECKPOINT_DTYPES[dtype_name(array.dtype)]
            buffer = self._staging.get(name)
            if buffer is None or buffer.shape != array.shape or buffer.dtype != dtype:
                buffer = np.empty(array.shape, dtype=dtype)
            staged[name] = buffer
        self._staging = staged  # buffers of names no longer saved are released
        pieces = [(staged[name], array) for name, array in arrays.items()]
        self._copy(pieces)
        return dict(staged)

    def _copy(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy every ``(dst, src)`` pair, split into equal byte shares per thread."""
        total = sum(dst.nbytes for dst, _ in pieces)
        if self._stagers is None or total < 2 * _MIN_SPLIT_BYTES:
            for dst, src in pieces:
                np.copyto(dst, src)
            return
        share = -(-total // self._threads)
        lanes: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self._threads)]
        lane, filled = 0, 0
        for dst, src in pieces:
            rows = dst.shape[0] if dst.ndim else 1
            row_bytes = dst.nbytes // rows if dst.ndim and rows else dst.nbytes
            start = 0
            while start < rows:
                if not dst.ndim or row_bytes == 0 or lane == self._threads - 1:
                    take = rows - start
                else:
                    take = max(1, min(rows - start, -(-(share - filled) // row_bytes)))
                if dst.ndim:
                    lanes[lane].append((dst[start:start + take], src[start:start + take]))
                else:
                    lanes[lane].append((dst, src))
                filled += take * row_bytes if dst.ndim else dst.nbytes
                start += take
                if filled >= share and lane < self._threads - 1:
                    lane, filled = lane + 1, 0

        def run(items: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for d, s in items:
                np.copyto(d, s)

        futures = [self._stagers.submit(run, items) for items in lanes[1:] if items]
        run(lanes[0])
        for future in futures:
            future.result()
