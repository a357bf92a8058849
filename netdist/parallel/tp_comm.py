"""Collectives called from synchronous layer code: what the tensor-parallel layers use.

netdist's layers (NumPy's ``forward``/``backward``, torch's autograd) are synchronous;
collectives are coroutines of a ``Group`` on one event loop. ``TPComm`` bridges the two
for a layer given ``group``, which is either

- a blocking proxy (``netdist.Blocking``: ``job.group`` of ``netdist.connect()``): the
  call blocks and runs on the job's progress thread, exactly as ``job.group.all_reduce``
  does from user code; or
- a plain asyncio ``Group``: the layer then runs in a thread other than the loop's (as
  netdist's pipeline and FSDP run layers, through ``asyncio.to_thread``), and the call
  hands the coroutine to the loop the group's transport lives on
  (``Transport.loop``) with ``asyncio.run_coroutine_threadsafe`` and waits for it,
  bounded by the group's timeout (the collective's own deadline fires first and raises
  its own error; the wait here only adds a grace period for the error to arrive).

Called from the loop's own thread either way, the wait could never end (the loop would
be waiting for itself), so it raises ``CollectiveError`` saying to run the compute in a
thread or to use the blocking API; no collective is started, and the group stays usable.

The operations take NumPy arrays or CPU torch tensors alike (``Group`` accepts both
zero-copy), so the NumPy and the torch layers share this one bridge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from netdist.collectives.group import Group
from netdist.errors import CollectiveError
from netdist.progress.proxy import Blocking
from netdist.progress.thread import wait_future
from netdist.tensors import as_array, is_tensor, to_tensor

__all__ = ["TPComm", "WAIT_GRACE"]

A = TypeVar("A")

WAIT_GRACE = 5.0
"""Seconds a synchronous caller waits beyond the group's timeout for a collective handed
to a plain ``Group``'s loop: the collective's own deadline (the group's timeout) raises
first, with its error naming the peer, and the grace lets that error arrive."""


@dataclass(frozen=True, slots=True)
class TPComm:
    """The tensor-parallel group of a layer, callable from synchronous code.

    ``group`` is a ``Blocking`` proxy of a ``Group`` or a ``Group`` itself (see the
    module docstring); anything else is a ``TypeError`` naming ``who`` (the layer).
    """

    group: Group | Blocking
    who: str

    def __post_init__(self) -> None:
        target = self.group.target if isinstance(self.group, Blocking) else self.group
        if not isinstance(target, Group):
            raise TypeError(f"{self.who}: group must be a netdist Group or a blocking proxy "
                            f"of one (job.group), got {type(self.group).__name__}")
        if not target.is_member:
            raise ValueError(f"{self.who}: this rank is not a member of the group")

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    @property
    def world_size(self) -> int:
        return int(self.group.world_size)

    def all_reduce(self, array: A, what: str) -> A:
        """Sum ``array`` over the group in place and return it (``what`` names the step
        in errors: "forward", "backward")."""
        return self._call("all_reduce", what, array)

    def all_gather(self, shard: A, out: A, what: str) -> A:
        """Concatenate every rank's ``shard`` along axis 0 into ``out`` (shard lengths by
        ``chunk_bounds(len(out), world_size)``) and return ``out``."""
        return self._call("all_gather", what, shard, out=out)

    def all_gather_last(self, local: A, total: int, what: str) -> A:
        """Every rank's ``local`` put side by side along the last dimension (``total``
        columns, each rank's ``chunk_bounds`` share in rank order): a new array, or a
        new tensor when ``local`` is a CPU torch tensor."""
        tensor = is_tensor(local)
        array = as_array(local, f"{self.who} {what}") if tensor else np.asarray(local)
        shard = np.ascontiguousarray(np.moveaxis(array, -1, 0))
        out = np.empty((total, *shard.shape[1:]), shard.dtype)
        self.all_gather(shard, out, what)
        gathered = np.ascontiguousarray(np.moveaxis(out, 0, -1))
        return to_tensor(gathered) if tensor else gathered  # type: ignore[return-value]

    def _call(self, op: str, what: str, *args: Any, **kwargs: Any) -> Any:
        group = self.group
        if isinstance(group, Blocking):
            if group.progress.on_thread():
                raise self._on_loop_error(op, what)
            return getattr(group, op)(*args, **kwargs)
        loop = group.transport.loop
        running = _running_loop()
        if running is not None and (loop is None or running is loop):
            raise self._on_loop_error(op, what)
        if loop is None:
            raise CollectiveError(
                f"{self.who} {what}: the {op} cannot be handed to the group's event loop: "
                f"its {type(group.transport).__name__} is bound to no loop; build the "
                "layer on a blocking group (netdist.connect(): job.group) or on a TCP one")
        coro: Coroutine[Any, Any, Any] = getattr(group, op)(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        return wait_future(future, group.timeout + WAIT_GRACE, f"{self.who} {what} {op}")

    def _on_loop_error(self, op: str, what: str) -> CollectiveError:
        return CollectiveError(
            f"{self.who} {what}: called on the thread running the group's event loop, "
            f"where waiting for its {op} would block that loop forever; run the layer's "
            "compute in a thread (await asyncio.to_thread(layer.forward, x)) or build the "
            "layer on the blocking API (netdist.connect(): job.group)")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
