"""Is Hugging Face's Trainer (or accelerate) training data-parallel over netdist?

accelerate decides on its own whether a job is distributed, and on a machine without
GPUs it gets this silently wrong for a process group it did not make. Only with
``use_cpu=True`` (``TrainingArguments``) or ``cpu=True`` (``Accelerator``) does it enter
its CPU mode and wrap the model in DDP over the default process group; without it,
every rank trains alone on its own shard of the data, and the only sign is a transformers
log line. A group made *after* ``TrainingArguments``/``Accelerator`` is too late:
accelerate has already initialised Gloo itself. :func:`check_data_parallel` turns each of
these into a ``netdist.errors.ConfigError`` that names the fix::

    import torch.distributed as dist
    import netdist.torch
    from netdist.torch.data_parallel_check import check_data_parallel

    dist.init_process_group("netdist")
    args = TrainingArguments(..., use_cpu=True)
    check_data_parallel(args)               # or an Accelerator, or a PartialState

It reads only public attributes (``distributed_state``, ``distributed_type``,
``num_processes``, ``device``) and imports neither transformers nor accelerate, so it
works for accelerate users without transformers. accelerate labels a CPU job's backend
``"gloo"`` whatever group it runs on (``state.backend``); the check asks
``torch.distributed`` instead.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from netdist.errors import ConfigError
from netdist.torch.backend import BACKEND_NAME

__all__ = ["check_data_parallel", "diagnose"]

_CPU_FLAGS = "use_cpu=True (TrainingArguments) or cpu=True (Accelerator)"


def diagnose(what: str, backend: str | None, world_size: int, distributed: bool,
             processes: int, device_type: str) -> str | None:
    """Why ``what`` does not train data-parallel over netdist's default group, or None.

    ``backend`` is the default process group's backend (None: no group), ``world_size``
    its size; ``distributed``, ``processes`` and ``device_type`` are accelerate's view
    (its distributed type is not ``NO``, its process count, its device). Pure, so every
    case is tested without processes.
    """
    if backend is None:
        return (f"{what}: torch.distributed's default process group is not initialised; "
                f"call torch.distributed.init_process_group({BACKEND_NAME!r}) before "
                f"creating {what}, otherwise accelerate initialises Gloo itself")
    if backend != BACKEND_NAME:
        return (f"{what}: the default process group runs on {backend!r}, not "
                f"{BACKEND_NAME!r}; call torch.distributed.init_process_group("
                f"{BACKEND_NAME!r}) before creating TrainingArguments or an Accelerator "
                f"(accelerate keeps a group that exists, and makes its own otherwise)")
    if device_type != "cpu":
        return (f"{what} trains on {device_type!r}, but netdist carries CPU tensors only: "
                f"pass {_CPU_FLAGS}")
    if world_size > 1 and not distributed:
        return (f"{what} trains each of the {world_size} ranks of the netdist group alone "
                f"(accelerate's distributed type is NO, so the model is not wrapped in "
                f"DDP): on a machine without GPUs accelerate uses an existing process "
                f"group only with {_CPU_FLAGS}")
    if world_size > 1 and processes != world_size:
        return (f"{what} counts {processes} processes, but the netdist group has "
                f"{world_size} ranks")
    return None


def check_data_parallel(obj: Any) -> None:
    """Raise ``ConfigError`` unless ``obj`` trains data-parallel over netdist's group.

    ``obj`` is a transformers ``TrainingArguments`` (its ``distributed_state`` is
    checked), an accelerate ``Accelerator``, ``PartialState`` or ``AcceleratorState``.
    Passes on a single process (a group of one rank needs no data parallelism).
    """
    what = type(obj).__name__
    state = getattr(obj, "distributed_state", obj)
    if state is None:  # TrainingArguments without accelerate's state (SageMaker MP)
        distributed, processes, device_type = False, 1, "cpu"
    else:
        kind = getattr(state, "distributed_type", "NO")
        distributed = str(getattr(kind, "value", kind)) != "NO"
        processes = int(getattr(state, "num_processes", 1))
        device = getattr(state, "device", None)
        device_type = getattr(device, "type", "cpu")
    backend = str(dist.get_backend()) if dist.is_initialized() else None
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    problem = diagnose(what, backend, world_size, distributed, processes, device_type)
    if problem is not None:
        raise ConfigError(problem)
