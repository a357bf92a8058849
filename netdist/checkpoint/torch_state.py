"""Torch tensors, modules and optimizers in checkpoints.

Imported only once a torch object has been seen in a state (``netdist.checkpoint.state``
detects tensors through ``sys.modules`` without importing torch), or when a bfloat16
tensor has to be handed out without ``ml_dtypes``; importing netdist never imports torch.

- :func:`tensor_array`: a NumPy view of a CPU tensor's memory (no copy, also for
  non-contiguous tensors and bfloat16), which is what the checkpoint code writes from
  and reads into, so a load with ``like`` fills parameters and optimizer state in place;
- :func:`array_tensor`: the inverse, a tensor over a NumPy buffer (no copy);
- :func:`alias_key`: identifies tensors that are the same view of the same storage (tied
  weights), which are stored once and restored as one tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from netdist.checkpoint.dtypes import CHECKPOINT_DTYPES, is_raw_bfloat16

__all__ = ["tensor_array", "array_tensor", "alias_key"]

_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64,
}


def tensor_array(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A NumPy array sharing ``tensor``'s memory (strides included, autograd detached).

    Raises ``TypeError`` naming ``name`` for a tensor a checkpoint cannot address
    directly: not on the CPU (move it with ``.cpu()``, an explicit copy), not strided
    (sparse, nested, quantized), or of a dtype without a safetensors code (complex,
    float8).
    """
    if tensor.device.type != "cpu":
        raise TypeError(f"{name!r}: the tensor is on device {tensor.device}; checkpoints "
                        f"read and write CPU memory: pass tensor.cpu() (a copy) instead")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"{name!r}: a {tensor.layout} tensor cannot be checkpointed; "
                        f"convert it to a dense tensor first")
    data = tensor.detach()
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(CHECKPOINT_DTYPES["bfloat16"])
    if data.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"{name!r}: torch dtype {data.dtype} cannot be stored in a "
                        f"checkpoint (safetensors codes exist for bool, (u)int8-64, "
                        f"float16, bfloat16, float32 and float64)")
    try:
        return data.numpy()
    except (RuntimeError, TypeError) as exc:  # tensor subclasses without a plain buffer
        raise TypeError(f"{name!r}: cannot address the memory of this "
                        f"{type(tensor).__name__} directly ({exc})") from exc


def array_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s buffer (no copy); bfloat16 arrays (NumPy ``ml_dtypes``
    or the raw stand-in) become ``torch.bfloat16`` tensors."""
    if array.dtype.name == "bfloat16" or is_raw_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def alias_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Equal for two tensors that are the same view of the same memory (tied weights:
    ``state_dict()`` returns one detached view per name); None for tensors that hold no
    element, which may share a null pointer without being related."""
    if tensor.numel() == 0 or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
