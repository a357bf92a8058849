"""``NetdistBackend``: netdist as torch's per-device ``Backend`` for the CPU.

``init_process_group("cpu:netdist,cuda:nccl")`` (either order) makes torch build the
``ProcessGroup`` itself and register one backend per device on it: this one for the CPU,
NCCL for CUDA. torch then dispatches every call by the device of its tensors, so CPU
tensors (and what torch runs on the CPU: ``barrier`` when the group is bound to no GPU,
``monitored_barrier``, the object collectives) come here and CUDA tensors go to NCCL. The calls are ``NetdistOps``', exactly as in a netdist-only group.

What a per-device Python backend cannot offer: torch's ``ProcessGroup`` hands back the
``Work`` of a Python backend wrapped in a C++ holder that forwards only ``wait()`` and
``get_future()``. On such a group ``work.is_completed()`` stays False (poll
``work.get_future().done()``), and the source rank of a receive from any source cannot
reach the caller, so that receive is refused up front (before a message is consumed)
rather than failing after it. A netdist-only group is a ``ProcessGroupNetdist`` and has
both.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from netdist.torch.backend import BACKEND_NAME, NetdistOps
from netdist.torch.work_handle import NetdistWork

__all__ = ["NetdistBackend"]


class NetdistBackend(NetdistOps, dist._Backend):
    """The CPU backend of a mixed torch process group (see the module docstring), reached
    as ``group._get_backend(torch.device("cpu"))``; made by
    ``netdist.torch.create_process_group``, not constructed directly."""

    @property
    def options(self) -> Any:
        """torch's ``Backend.Options`` for this backend (its name and timeout)."""
        return dist._Backend.Options(BACKEND_NAME, timedelta(seconds=self._seconds))

    # torch reads these capabilities through the C++ base, which asks this Python class
    # back for them: left undefined, the lookup finds the base's own property and recurses
    supports_coalescing = False
    supports_splitting = False
    supports_shrinking = False
    supports_reconfigure = False
    supports_window = False
    _supports_time_estimate = False

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> NetdistWork:
        """Refused: torch cannot read the source rank of this backend's ``Work``."""
        raise ValueError(
            "recv: a receive from any source (src=None) is not available when netdist is "
            "one backend of a mixed group (torch's ProcessGroup cannot pass the source "
            "rank of a Python backend's work back to the caller); pass src=, or use "
            "init_process_group('netdist') for a netdist-only group")
