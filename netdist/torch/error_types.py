"""netdist's failures as the error types torch users catch.

Code written against ``torch.distributed`` catches ``torch.distributed.DistError`` and its
subclasses (``DistNetworkError`` for a lost peer, ``DistBackendError`` for the rest); the
backend raises those, with netdist's message (which names the operation, the group and the
rank to blame) and the original ``netdist.errors`` exception as ``__cause__`` and as
``netdist_error``. Mistakes in the arguments (wrong shapes, dtypes, ranks) stay the
``ValueError`` / ``TypeError`` they are, as with Gloo.
"""

from __future__ import annotations

import torch.distributed as dist

from netdist.errors import (
    CollectiveMismatchError,
    ConnectError,
    NetdistError,
    NetdistTimeoutError,
    PeerLostError,
    TransportClosedError,
)

__all__ = ["NetdistDistError", "NetdistNetworkError", "NetdistTimeout", "to_torch_error"]


class NetdistDistError(dist.DistBackendError):
    """A netdist failure inside a ``torch.distributed`` call (see ``netdist_error``)."""

    netdist_error: BaseException | None = None


class NetdistNetworkError(dist.DistNetworkError):
    """A peer was lost, could not be reached, or the transport is closed."""

    netdist_error: BaseException | None = None


class NetdistTimeout(NetdistDistError, TimeoutError):
    """An operation did not finish within its timeout (``init_process_group(timeout=)``
    or ``work.wait(timeout)``)."""


def to_torch_error(exc: BaseException) -> BaseException:
    """The exception a torch user should see for ``exc`` raised by netdist."""
    if isinstance(exc, (dist.DistError, TypeError)) or (
            isinstance(exc, ValueError) and not isinstance(exc, CollectiveMismatchError)):
        return exc
    error: NetdistDistError | NetdistNetworkError
    if isinstance(exc, (PeerLostError, ConnectError, TransportClosedError)):
        error = NetdistNetworkError(str(exc))
    elif isinstance(exc, (NetdistTimeoutError, TimeoutError)):
        # torch users (and torch's own tests) look for "Timed out" in Gloo's words
        error = NetdistTimeout(f"[netdist] Timed out ({exc})" if "monitoredBarrier" not in
                               str(exc) else str(exc))
    elif isinstance(exc, NetdistError):
        error = NetdistDistError(str(exc))
    else:
        return exc
    error.netdist_error = exc
    error.__cause__ = exc
    return error
