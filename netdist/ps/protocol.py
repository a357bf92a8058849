"""PURE wire vocabulary of the parameter server: tags, message kinds, fixed headers.

Every parameter-server message is a plain array on the ``Transport``; control messages
are a fixed-length ``int64`` header, so no serializer runs on the hot path (parameter
specifications and error texts are msgpack or UTF-8 bytes, sent once).

Each parameter server talks on a ``TagRange`` it reserves from its group
(``Group.reserve_tags``, owner ``SYNC_OWNER`` or ``SHARDED_OWNER``), so parameter servers,
pipelines and collectives sharing a transport never meet on a tag, and a second server on
the same ranks gets a range of its own. Within the range, chunk ``index`` of ``stream``
is at ``stream * 2**24 + index``: the stream is gradients, averages, control, ..., the
index a piece or segment of it, so every piece has its own tag and posted receives can
never be matched out of order.
"""

from __future__ import annotations

import enum

import numpy as np

from netdist.collectives.tags import TagRange

__all__ = [
    "SYNC_OWNER",
    "SHARDED_OWNER",
    "TAG_KIND_STRIDE",
    "MAX_CHUNKS",
    "SyncStream",
    "ShardedStream",
    "Kind",
    "PUSH",
    "PULL",
    "HEADER_LEN",
    "NO_STALENESS_BOUND",
    "stream_tag",
    "encode_header",
    "decode_header",
    "check_tag_range",
    "shard_tag_range",
]

SYNC_OWNER = "ps.sync"
"""Owner name of the tag ranges ``ParameterServer`` (sync, rank-0 server) reserves."""

SHARDED_OWNER = "ps.sharded"
"""Owner name of the tag ranges ``PSServer`` / ``PSClient`` / ``ColocatedPS`` reserve."""

TAG_KIND_STRIDE = 2**24
MAX_CHUNKS = TAG_KIND_STRIDE
"""Upper bound on chunks per stream (one tag each)."""

_TAG_SPAN = 8 * TAG_KIND_STRIDE
"""Tags used by one parameter server: 8 streams of ``TAG_KIND_STRIDE`` tags."""


class SyncStream(enum.IntEnum):
    """Streams of the sync rank-0 parameter server."""

    GRAD = 0
    """worker -> server: gradient piece k on tag ``GRAD + k`` (see ``plan_pieces``)."""
    AVG = 1
    """server -> worker: averaged gradient piece k."""
    PARAMS = 2
    """server -> worker: parameter piece k (``broadcast_params``)."""
    ERROR = 3
    """server -> worker: UTF-8 text of a failure that ends the round on every rank."""
    LAYOUT = 4
    """worker -> server: msgpack signature of a new tensor layout (sent once per layout)."""


class ShardedStream(enum.IntEnum):
    """Streams between dedicated servers and their workers."""

    CTRL = 0
    """worker -> server: ``int64`` header (``Kind``, flags, version)."""
    DATA = 1
    """worker -> server: spec bytes and initial values (index 0, at init), then gradient
    segment k on ``DATA + k`` (see ``plan_segments``)."""
    REPLY = 2
    """server -> worker: ``int64`` header answering INIT / PULL, or ERROR."""
    PARAMS = 3
    """server -> worker: parameter segment k on ``PARAMS + k`` (after an OK reply to a pull)."""
    ERRMSG = 4
    """server -> worker / worker -> server: UTF-8 error text after an ERROR/ABORT header."""
    REPLICATE = 5
    """primary -> backup server of a shard: ``int64`` header (``REPLICA_*`` kinds)."""
    REPLICA_DATA = 6
    """primary -> backup: the payloads after a ``REPLICA_*`` header, piece k on
    ``REPLICA_DATA + k``."""
    REPLICA_ACK = 7
    """backup -> primary: ``[REPLICA_ACK, version, 0, 0]`` once an event has applied."""


class Kind(enum.IntEnum):
    """Header kinds (slot 0 of every header)."""

    INIT = 1
    """worker -> server: [INIT, has_values, 0, 0], then spec bytes (+ values from worker 0)."""
    REQUEST = 2
    """worker -> server: [REQUEST, flags (PUSH|PULL), base version, sequence]."""
    DONE = 3
    """worker -> server: the worker has finished; no more messages from it."""
    ABORT = 4
    """worker -> server: the worker failed; error text follows on ERRMSG."""
    OK = 5
    """server -> worker: answering INIT ``[OK, 0, max_staleness or -1, 0]``; answering a
    pull ``[OK, version, 0, 0]``, then the parameters."""
    ERROR = 6
    """server -> worker: [ERROR, culprit rank or -1, 0, 0]; error text follows."""
    REPLICA_INIT = 7
    """primary -> backup: [REPLICA_INIT, 0, 0, 0], then the init map (msgpack: specs,
    options) on piece 0 and the shard's initial values on piece 1."""
    REPLICA_APPLY = 8
    """primary -> backup: [REPLICA_APPLY, n, version before, divisor], then an ``int64``
    table of ``n`` rows (worker index, sequence, base) on piece 0 and the ``n`` flat
    gradients, in update order, on pieces 1..n."""
    REPLICA_DROP = 9
    """primary -> backup: [REPLICA_DROP, worker index, 0, 0]: the worker finished or was
    dropped (not acknowledged)."""
    REPLICA_FINISH = 10
    """primary -> backup: [REPLICA_FINISH, version, 0, 0]: the shard is done serving."""
    REPLICA_ACK = 11
    """backup -> primary: [REPLICA_ACK, version, 0, 0]."""


PUSH = 1
"""REQUEST flag: a gradient shard follows on DATA."""
PULL = 2
"""REQUEST flag: answer with the parameters once this worker's push is applied."""

HEADER_LEN = 4
NO_STALENESS_BOUND = -1
"""``max_staleness=None`` (fully asynchronous) on the wire."""


def shard_tag_range(tags: TagRange, shard: int) -> TagRange:
    """The tags of shard ``shard`` in a replicated job's range ``tags``.

    With replicas a server rank may serve two shards (its own and one it took over), so
    each shard talks on a span of its own: span ``shard`` of the range, whichever rank
    serves it. A range holds ``MAX_REPLICATED_SHARDS`` spans.
    """
    if not 0 <= shard < tags.size // _TAG_SPAN:
        raise ValueError(f"shard {shard} is outside the {tags.size // _TAG_SPAN} shards "
                         f"{tags.owner}'s range can hold")
    return TagRange(tags.owner, tags.base + shard * _TAG_SPAN, _TAG_SPAN)


def check_tag_range(tags: TagRange) -> TagRange:
    """Validate a reserved range: a ``TagRange`` holding every stream's tags."""
    if not isinstance(tags, TagRange):
        raise TypeError(f"tags must be a TagRange (from Group.reserve_tags), got "
                        f"{type(tags).__name__}")
    if tags.size < _TAG_SPAN:
        raise ValueError(f"the parameter server needs {_TAG_SPAN} tags, {tags.owner}'s range "
                         f"holds {tags.size}")
    return tags


def stream_tag(tags: TagRange, stream: int, index: int = 0) -> int:
    """The transport tag of chunk ``index`` of ``stream`` in the server's range ``tags``."""
    if not 0 <= index < MAX_CHUNKS:
        raise ValueError(f"chunk index {index} is outside 0..{MAX_CHUNKS - 1}")
    return tags.base + int(stream) * TAG_KIND_STRIDE + index


def encode_header(kind: Kind, a: int = 0, b: int = 0, c: int = 0) -> np.ndarray:
    """A fixed-length ``int64`` header ``[kind, a, b, c]``."""
    return np.array([int(kind), a, b, c], dtype=np.int64)


def decode_header(header: np.ndarray, *, peer: int) -> tuple[Kind, int, int, int]:
    """Parse a header from ``peer``; ``ValueError`` if it is not one."""
    if header.dtype != np.int64 or header.shape != (HEADER_LEN,):
        raise ValueError(f"rank {peer} sent a {header.dtype}{list(header.shape)} message "
                         f"where a parameter-server header (int64[{HEADER_LEN}]) belongs")
    try:
        kind = Kind(int(header[0]))
    except ValueError:
        raise ValueError(f"rank {peer} sent unknown parameter-server message kind "
                         f"{int(header[0])}") from None
    return kind, int(header[1]), int(header[2]), int(header[3])
