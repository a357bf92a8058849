"""The netdist exception tree.

Every failure netdist reports is one of these; OS and asyncio exceptions
(``ConnectionResetError``, ``asyncio.IncompleteReadError``, ...) are translated at
the transport boundary, in one place (``netdist.transport.os_errors``), and never
escape to callers.

::

    NetdistError
    ├── ConfigError (ValueError)            bad configuration or environment
    ├── ProtocolError
    │   ├── LocalProtocolError              we were asked to send something invalid
    │   └── RemoteProtocolError             a peer sent bytes that are not a valid frame
    ├── TransportError
    │   ├── ConnectError                    could not reach a peer / the coordinator
    │   │   └── AuthenticationError         handshake refused (token, job id, version, rank)
    │   ├── PeerLostError                   a connected peer went away (EOF, reset, heartbeats,
    │   │                                   BYE); ``origin_rank`` names who went away first
    │   ├── TransportClosedError            the local transport was closed
    │   ├── UndeliveredError                a clean close could not hand a peer every
    │   │                                   byte already reported sent (names the bytes)
    │   └── SharedMemoryError               a same-host shared-memory segment could not be
    │                                       made or attached (the group falls back to TCP)
    ├── NetdistTimeoutError (TimeoutError)  a bounded wait expired
    │   └── RendezvousTimeoutError          ranks never arrived at the coordinator
    ├── RendezvousError                     duplicate ranks, world-size mismatch
    ├── CollectiveError                     collective misuse or a remote rank's failure
    │   ├── CollectiveMismatchError (ValueError)  ranks passed incompatible sizes/dtypes
    │   └── NotInGroupError                 calling into a group this rank is not part of
    ├── TensorDeviceError (ValueError)      a torch tensor off the CPU (cuda, meta) or not
    │                                       dense (sparse): move it with .cpu()
    ├── BlockingCallError (RuntimeError)    a blocking call made on the event loop that
    │                                       must complete it (it would deadlock)
    ├── ParameterServerError                a server or worker failed or misbehaved
    ├── FSDPError (RuntimeError)            FSDP used out of order: closed, no optimizer,
    │                                       no forward context, a gather in flight
    ├── PipelineError                       invalid pipeline configuration or schedule
    ├── TraceError (ValueError)             a trace file or flight-recorder dump is missing,
    │                                       truncated or breaks the format (names the file)
    ├── QuantizationError (ValueError)      a value to quantize is NaN, infinite or beyond
    │                                       +-2**126 (names where); quantized collectives
    │                                       raise it on every rank the bad value reached
    └── CheckpointError
        ├── CheckpointNotFoundError         no complete checkpoint / missing shard file
        ├── CheckpointCorruptError          checksum mismatch, truncated or unreadable file
        ├── CheckpointVersionError          written by a newer format version
        └── CheckpointMismatchError         dtype / shape / world-size mismatch against a target

Messages state facts with context: which operation, which peer, which tag, how long.
"""

from __future__ import annotations

__all__ = [
    "NetdistError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "ConnectError",
    "AuthenticationError",
    "PeerLostError",
    "ElasticError",
    "QuorumLostError",
    "StateTransferError",
    "DivergenceError",
    "TransportClosedError",
    "UndeliveredError",
    "SharedMemoryError",
    "NetdistTimeoutError",
    "RendezvousTimeoutError",
    "RendezvousError",
    "CollectiveError",
    "CollectiveMismatchError",
    "NotInGroupError",
    "ObjectEncodeError",
    "TensorDeviceError",
    "BlockingCallError",
    "ParameterServerError",
    "FSDPError",
    "PipelineError",
    "TraceError",
    "QuantizationError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
    "CheckpointMismatchError",
]


class NetdistError(Exception):
    """Root of every exception netdist raises on purpose."""


class ConfigError(NetdistError, ValueError):
    """Invalid configuration: arguments, environment variables or limits."""


class ProtocolError(NetdistError):
    """The wire protocol was violated."""


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the protocol cannot carry (bad dtype, too large)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that do not form a valid frame; the connection is closed."""


class TransportError(NetdistError):
    """A connection-level failure."""


class ConnectError(TransportError):
    """A peer or the coordinator could not be reached."""


class AuthenticationError(ConnectError):
    """The handshake was refused: wrong token, job id, protocol version or rank.

    ``code`` names the kind of refusal when the refusing side said it (the ERROR frame's
    ``code``: ``"version"``, ``"job_id"``, ``"world_size"``, ``"rank_range"``, ``"role"``,
    ``"rank"``, ``"token"``), so callers can act on it without parsing the message.
    """

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class PeerLostError(TransportError):
    """A connected peer went away; every pending and later operation on it fails.

    ``rank`` is the peer whose connection failed. ``origin_rank`` is the rank whose
    departure started it all: ``rank`` itself when it crashed, was killed, stalled,
    failed or left, or another rank when ``rank`` aborted *because* it had lost that one
    (its last frame said so, see docs/PROTOCOL.md section 7); ``via`` is then ``rank``,
    the messenger. ``origin_reason`` is the one-line account of what happened at the
    origin ("rank 5 closed the connection (EOF)"). Launchers and users blame
    ``origin_rank``; the message leads with it.
    """

    def __init__(self, rank: int, message: str | None = None, *,
                 origin_rank: int | None = None, origin_reason: str | None = None) -> None:
        self.rank = rank
        self.origin_rank = rank if origin_rank is None else origin_rank
        text = message or f"lost connection to rank {rank}"
        self.origin_reason = origin_reason or text
        super().__init__(text)

    @property
    def via(self) -> int | None:
        """The rank that relayed the loss (``rank``), or None when ``rank`` is the origin."""
        return None if self.origin_rank == self.rank else self.rank

    def with_message(self, message: str) -> PeerLostError:
        """The same loss (``rank``, ``origin_rank``, ``origin_reason``) told by ``message``.

        For layers that add context (the operation, the tag, the group) without losing
        who went away first.
        """
        return PeerLostError(self.rank, message, origin_rank=self.origin_rank,
                             origin_reason=self.origin_reason)


class TransportClosedError(TransportError):
    """The local transport was closed while (or before) the operation ran."""


class UndeliveredError(TransportError):
    """Closing cleanly, this rank could not deliver bytes its sends already reported done.

    A send returns once the bytes are with the kernel; a clean close (``aclose``, leaving
    ``async with``, ``Job.close``, torch's ``destroy_process_group``) waits until every
    peer's kernel has acknowledged them and the peer has read up to this rank's goodbye,
    bounded by the operation timeout. ``undelivered`` maps each peer that did not get
    everything to the bytes still unacknowledged (``-1``: the platform cannot count them).
    """

    def __init__(self, message: str, undelivered: dict[int, int]) -> None:
        super().__init__(message)
        self.undelivered = dict(undelivered)


class SharedMemoryError(TransportError):
    """A shared-memory segment between ranks on one host could not be created or attached."""


class NetdistTimeoutError(NetdistError, TimeoutError):
    """A bounded wait expired. The message names operation, peer, tag and elapsed time."""


class RendezvousTimeoutError(NetdistTimeoutError):
    """Not every rank reached the coordinator in time; ``missing`` lists the absent ranks."""

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        self.missing = missing
        super().__init__(message)


class RendezvousError(NetdistError):
    """The ranks that arrived cannot form a job: duplicates or a world-size mismatch."""


class CollectiveError(NetdistError):
    """A collective was misused, or failed on another rank."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called the same collective with incompatible shapes, sizes or dtypes."""


class NotInGroupError(CollectiveError):
    """This rank called into a group it is not a member of."""


class ObjectEncodeError(CollectiveError, TypeError):
    """This rank's object for an object collective cannot be encoded with msgpack
    (netdist never pickles); the other ranks get a ``CollectiveError`` naming this rank."""


class TensorDeviceError(NetdistError, ValueError):
    """A torch tensor whose memory netdist cannot view in place: on a device other than
    the CPU (``cuda``, ``meta``, ...) or not dense (sparse). The message names the device
    or layout and the fix (``.cpu()``, ``.to_dense()``). Every API that takes tensors
    raises it: collectives, aggregators, the parameter server, FSDP, the torch backend
    and checkpoints."""


class BlockingCallError(NetdistError, RuntimeError):
    """A blocking call was made from the event loop that has to run what it waits for:
    ``ProgressThread.run()`` or ``close()`` on the progress thread's own loop. It would
    deadlock, so it is refused; await the coroutine on that loop instead."""


class ParameterServerError(NetdistError):
    """A parameter server or one of its workers failed or broke the protocol."""


class FSDPError(NetdistError, RuntimeError):
    """FSDP was used out of order: after ``aclose``, ``step`` without an optimizer,
    ``backward`` without a forward context, shards changed while an all-gather is in
    flight (or FSDP's own state is inconsistent, which is a bug)."""


class PipelineError(NetdistError):
    """Invalid pipeline configuration, or a stage failed."""


class TraceError(NetdistError, ValueError):
    """A trace file or flight-recorder dump (``netdist trace``, docs: trace format v1) is
    missing, truncated, not JSON or breaks the format, or a directory holds none to
    analyse. The message names the file (``path``, when there is one) and what is wrong
    with it, so an offline analysis never fails with a bare ``KeyError``."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class QuantizationError(NetdistError, ValueError):
    """A value to quantize (``netdist.compression.quantize``) is NaN, infinite or beyond
    ``+-2**126``, where int8/int4 codes with float32 scales cannot represent it. The
    message names the element (or, from a quantized collective, the ranks and shards)."""


class CheckpointError(NetdistError):
    """A checkpoint could not be written or read."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was expected, or a shard file is missing."""


class CheckpointCorruptError(CheckpointError):
    """A shard or metadata file is truncated, unreadable or fails its checksum."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written by a newer, unknown format version."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not match the target: dtype, shape or world size."""


class ElasticError(NetdistError):
    """An elastic job (``netdist.elastic``) could not go on: see the subclasses."""


class QuorumLostError(ElasticError):
    """This process is on the minority side of a failure: fewer than a strict majority of
    the last membership could agree on a new one, so this side stops (the majority side,
    if there is one, carries on). ``members`` are the ones this side could reach."""

    def __init__(self, message: str, members: tuple[int, ...] = ()) -> None:
        self.members = members
        super().__init__(message)


class StateTransferError(ElasticError):
    """A joining member's state did not arrive intact: the bytes fetched from the donors
    do not hash to the value the donors agreed on, or the layouts differ."""


class DivergenceError(ElasticError):
    """Members that committed the same step hold different states (different hashes):
    the job stops rather than train on diverged replicas."""
