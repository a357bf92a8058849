"""Which backends the torch process group now being built has, device by device.

torch calls a backend's factory once per device of the backend string and passes it the
store, ranks and timeout, but not the string itself; netdist needs it to tell a
netdist-only group (``"netdist"``, ``"cpu:netdist"``: netdist is the whole group, a
``ProcessGroupNetdist``) from a mixed one (``"cpu:netdist,cuda:nccl"``: netdist is the CPU
``Backend`` beside NCCL). torch keeps the parsed string, a ``BackendConfig``, in the frame
of ``torch.distributed.distributed_c10d._new_process_group_helper``, which calls the
factory; this reads it from there. When it cannot (another caller, a torch that changed
the helper), it answers ``None`` and the caller takes the per-device backend, the choice
that never drops another device's backend.
"""

from __future__ import annotations

import sys

from torch.distributed import distributed_c10d as c10d

__all__ = ["devices_of_group_being_built"]

_HELPER = "_new_process_group_helper"
_MAX_DEPTH = 8
"""Frames searched above the caller: torch calls the factory from the helper directly."""


def devices_of_group_being_built() -> dict[str, str] | None:
    """The ``{device type: backend name}`` map of the group torch is building (the caller
    is a backend factory torch called), or ``None`` when it cannot be read."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        frame_or_none = frame.f_back
        if frame_or_none is None:
            return None
        frame = frame_or_none
        if frame.f_code.co_name == _HELPER and frame.f_globals.get("__name__") == c10d.__name__:
            config = frame.f_locals.get("backend_config")
            if isinstance(config, c10d.BackendConfig):
                return {str(device): str(name)
                        for device, name in config.get_device_backend_map().items()}
            return None
    return None
