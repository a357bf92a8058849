"""Primary-backup replication of one server shard: both ends of the channel.

``BackupLink`` is the primary's end. Before a server acknowledges anything to a worker
(the ``OK`` answering an init or a pull) the backup has applied it: the primary sends
every update -- which workers' gradients, their request sequence numbers, the gradients
themselves, the divisor -- and waits for the backup's ``REPLICA_ACK``. The backup runs
the same ``ServerShard.apply`` on the same bytes in the same order, so its shard is
bit-for-bit the primary's at every acknowledged version.

``ShardBackup`` is the backup's end: it mirrors the primary until the primary finishes
(``REPLICA_FINISH``) or is lost (``PeerLostError`` from the transport: a killed process
in well under a second, a stopped one after the liveness window). Then it hands back a
``ReplicaState`` -- shard, version, applied sequence numbers, departed workers -- from
which the backup server takes the shard over (``PSServer`` does that part).

Messages (on the shard's tag span, ``netdist.ps.protocol``): ``REPLICATE`` headers of the
``REPLICA_*`` kinds, their payloads on ``REPLICA_DATA``, acknowledgements on
``REPLICA_ACK``. A backup that is lost leaves the primary serving alone (degraded, logged);
a backup that stays silent past the timeout fails the primary, so an update is never
acknowledged as replicated when it was not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from netdist.collectives.tags import TagRange
from netdist.errors import NetdistError, NetdistTimeoutError, ParameterServerError, PeerLostError
from netdist.optim import optimizer_config_from_dict
from netdist.ps._link import Endpoint
from netdist.ps.protocol import Kind, ShardedStream, decode_header, encode_header, stream_tag
from netdist.ps.shard import ServerShard
from netdist.ps.staleness import VersionLogEntry

__all__ = ["UpdateRecord", "BackupLink", "ReplicaState", "ShardBackup"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """One worker's share of a replicated update."""

    worker: int
    """Worker index (0-based among the workers)."""
    sequence: int
    """The worker's request sequence number: a retried request with it is not reapplied."""
    base: int
    """The version the gradient was computed on."""


class BackupLink:
    """The primary's end of the replication channel of one shard (see the module doc).

    ``backup`` is the group rank of the backup server; ``tags`` the shard's tag span.
    ``alive`` turns False once the backup is lost: the shard is then served unreplicated.
    """

    def __init__(self, endpoint: Endpoint, backup: int, tags: TagRange, shard: int) -> None:
        self._ep = endpoint
        self.backup = backup
        self.shard = shard
        self._tags = tags
        self._lock = asyncio.Lock()
        self.alive = True

    def _tag(self, stream: ShardedStream, index: int = 0) -> int:
        return stream_tag(self._tags, stream, index)

    async def init(self, meta: bytes, values: np.ndarray) -> None:
        """Hand the backup the init map and the shard's initial values; wait for its ack."""
        await self._event(encode_header(Kind.REPLICA_INIT),
                          [np.frombuffer(meta, np.uint8), values], ack=True)

    async def apply(self, records: Sequence[UpdateRecord], grads: Sequence[np.ndarray],
                    version: int, divisor: int) -> None:
        """Have the backup apply one update onto ``version``; return once it has."""
        table = np.array([(r.worker, r.sequence, r.base) for r in records],
                         dtype=np.int64).reshape(-1, 3)
        await self._event(encode_header(Kind.REPLICA_APPLY, len(records), version, divisor),
                          [table, *grads], ack=True)

    async def drop(self, worker: int) -> None:
        """Tell the backup worker ``worker`` finished or was dropped (no ack awaited)."""
        await self._event(encode_header(Kind.REPLICA_DROP, worker), [], ack=False)

    async def finish(self, version: int) -> None:
        """Tell the backup the shard is done serving at ``version`` (no ack awaited)."""
        await self._event(encode_header(Kind.REPLICA_FINISH, version), [], ack=False)

    async def _event(self, header: np.ndarray, payloads: Sequence[np.ndarray], *,
                     ack: bool) -> None:
        async with self._lock:
            if not self.alive:
                return
            try:
                await self._ep.send(self.backup, header, self._tag(ShardedStream.REPLICATE))
                for index, payload in enumerate(payloads):
                    await self._ep.send(self.backup, payload,
                                        self._tag(ShardedStream.REPLICA_DATA, index))
                if ack:
                    raw = await self._ep.recv(self.backup, self._tag(ShardedStream.REPLICA_ACK))
                    kind, _, _, _ = decode_header(raw, peer=self.backup)
                    if kind is not Kind.REPLICA_ACK:
                        raise ParameterServerError(f"backup server rank {self.backup} sent "
                                                   f"{kind.name} instead of REPLICA_ACK")
            except PeerLostError as exc:
                self.alive = False
                logger.warning("netdist: shard %d lost its backup (server rank %d): %s; "
                               "serving it unreplicated", self.shard, self.backup, exc)
            except NetdistTimeoutError as exc:
                raise ParameterServerError(
                    f"backup server rank {self.backup} of shard {self.shard} did not "
                    f"acknowledge an update: {exc}") from exc
            except ValueError as exc:
                raise ParameterServerError(f"shard {self.shard} replication: {exc}") from None


@dataclass(slots=True)
class ReplicaState:
    """What a backup holds of its shard: enough for it to take the shard over."""

    meta: dict[str, Any]
    """The init map the workers sent (specs, optimizer, options)."""
    shard: ServerShard
    version: int = 0
    log: list[VersionLogEntry] = field(default_factory=list)
    applied: dict[int, int] = field(default_factory=dict)
    """Worker index -> sequence number of its last applied push."""
    done: set[int] = field(default_factory=set)
    """Workers that finished or were dropped."""


class ShardBackup:
    """The backup's end of the replication channel of shard ``shard`` (module doc).

    ``primary`` is the group rank of the shard's primary; ``tags`` the shard's tag span.
    ``run()`` returns None when the primary finishes, or the ``ReplicaState`` to take over
    from when it is lost. A primary that is lost before the shard was initialised leaves
    nothing to take over: ``ParameterServerError``.
    """

    def __init__(self, endpoint: Endpoint, primary: int, tags: TagRange, shard: int) -> None:
        self._ep = endpoint
        self.primary = primary
        self.shard = shard
        self._tags = tags
        self.state: ReplicaState | None = None
        self.lost: PeerLostError | None = None
        """The primary's loss, once seen."""

    def _tag(self, stream: ShardedStream, index: int = 0) -> int:
        return stream_tag(self._tags, stream, index)

    async def _data(self, index: int) -> np.ndarray:
        return await self._ep.recv(self.primary, self._tag(ShardedStream.REPLICA_DATA, index))

    async def run(self) -> ReplicaState | None:
        """Mirror the primary; None when it finishes, the state to take over when lost.

        Waits for the primary without a deadline of its own: the transport's liveness
        check ends the wait if the primary dies or stops (each receive is bounded by the
        timeout and simply posted again while the primary is alive and idle).
        """
        while True:
            try:
                raw = await self._ep.recv(self.primary, self._tag(ShardedStream.REPLICATE))
                if await self._handle(raw):
                    return None
            except NetdistTimeoutError:
                continue  # an idle primary: its liveness is the transport's to judge
            except PeerLostError as exc:
                self.lost = exc
                if self.state is None:
                    raise ParameterServerError(
                        f"shard {self.shard}'s primary (server rank {self.primary}) was "
                        f"lost before the shard was initialised: {exc}") from exc
                logger.warning("netdist: shard %d's primary (server rank %d) is lost at "
                               "version %d: taking it over", self.shard, self.primary,
                               self.state.version)
                return self.state
            except NetdistError:
                raise
            except (ValueError, msgpack.UnpackException) as exc:
                raise ParameterServerError(
                    f"shard {self.shard} replication from server rank {self.primary}: "
                    f"{exc}") from None

    async def _ack(self, version: int) -> None:
        await self._ep.send(self.primary, encode_header(Kind.REPLICA_ACK, version),
                            self._tag(ShardedStream.REPLICA_ACK))

    async def _handle(self, raw: np.ndarray) -> bool:
        """Apply one event; True once the primary is finished. Nothing changes until an
        event has fully arrived, so a primary lost mid-event leaves the last whole state."""
        kind, a, b, c = decode_header(raw, peer=self.primary)
        if kind is Kind.REPLICA_FINISH:
            return True
        if kind is Kind.REPLICA_INIT:
            meta_raw = await self._data(0)
            values = await self._data(1)
            meta = msgpack.unpackb(meta_raw.tobytes())
            shard = ServerShard(optimizer_config_from_dict(meta["optimizer"]), values.copy())
            self.state = ReplicaState(meta, shard)
            await self._ack(0)
            return False
        state = self.state
        if state is None:
            raise ValueError(f"{kind.name} before REPLICA_INIT")
        if kind is Kind.REPLICA_DROP:
            state.done.add(a)
            return False
        if kind is not Kind.REPLICA_APPLY:
            raise ValueError(f"unexpected {kind.name} on the replication stream")
        count, version, divisor = a, b, c
        table = await self._data(0)
        grads = [await self._data(1 + i) for i in range(count)]
        if version != state.version:
            raise ValueError(f"update onto version {version}, the backup is at "
                             f"{state.version}")
        state.shard.apply(grads, divisor)
        for worker, sequence, base in table.reshape(-1, 3).tolist():
            state.log.append(VersionLogEntry(worker, base, version))
            state.applied[worker] = sequence
        state.version += 1
        await self._ack(state.version)
        return False
