"""Torch tensors in netdist's own API: NumPy views of their memory, and back.

netdist's collectives, aggregators and parameter-server client work on NumPy arrays.
Wherever they take an array they also take a CPU ``torch.Tensor`` (or ``Parameter``),
through this module, the only place in those layers that touches torch:

- **Zero-copy.** ``as_array(t)`` is a NumPy view of the tensor's own memory, with the
  tensor's shape and strides (``t.detach().numpy()``; bfloat16 through its bits, see
  below). A collective that works in place on the array works in place on the tensor.
- **Results come back as tensors when tensors went in.** ``to_tensor(a)`` is
  ``torch.from_numpy`` over the result buffer (no copy); an in-place collective returns
  the very tensor it was given.
- **Copies, named.** A non-contiguous tensor is handled exactly like a non-contiguous
  NumPy array: collectives that read it send a contiguous copy; collectives that work in
  place on it (``all_reduce``, ``broadcast``, ``reduce``) reduce a contiguous copy and copy
  the result back into the tensor. A non-contiguous ``out=`` tensor is filled through a
  contiguous stand-in (``stage_out``) that is copied back once the data is in. A tensor
  whose elements overlap in memory (``expand()``) is refused where netdist writes to it.
- **Errors, clear.** A tensor not on the CPU (``cuda``, ``meta``, ...) or not dense
  (sparse) raises ``netdist.errors.TensorDeviceError`` (a ``ValueError``) naming its
  device or layout: move it with ``.cpu()``. A tensor whose dtype NumPy cannot view
  (complex with the conjugate bit, float8, ...) raises ``TypeError``.
- **One conversion.** ``as_array`` is the only code in netdist that turns a tensor into
  an array: the torch backend (``netdist.torch.array_views``) and checkpoints
  (``netdist.checkpoint.torch_state``) call it with their own ``TensorRules`` (their
  wording, the dtypes they take), and ``check_tensor`` is its checks alone.
- **bfloat16.** A ``torch.bfloat16`` tensor becomes an array of ``netdist.types.BFLOAT16``
  over the same memory: ``ml_dtypes.bfloat16`` where installed, else ``BFLOAT16_RAW``
  (the raw 16-bit data, which netdist's reductions and the wire understand); see
  ``netdist.types``. Results of that dtype come back as ``torch.bfloat16`` tensors.

torch stays optional: a tensor can only exist once torch has been imported, so
``is_tensor`` looks it up in ``sys.modules``, and only making a tensor (``to_tensor``)
imports it. ``import netdist`` never imports torch, and NumPy callers pay one
``isinstance(x, np.ndarray)`` per argument.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import TensorDeviceError
from netdist.types import BF16_EXTRA_HINT, BFLOAT16, BFLOAT16_RAW, is_bfloat16

__all__ = [
    "is_tensor",
    "any_tensor",
    "TensorRules",
    "check_tensor",
    "as_array",
    "as_arrays",
    "to_tensor",
    "StagedOut",
    "stage_out",
    "numpy_result",
]


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(obj: object) -> bool:
    """True if ``obj`` is a ``torch.Tensor`` (never imports torch)."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def any_tensor(objs: Sequence[Any]) -> bool:
    """True if any element of ``objs`` is a ``torch.Tensor``."""
    torch = _torch()
    return torch is not None and any(isinstance(o, torch.Tensor) for o in objs)


@dataclass(frozen=True, slots=True)
class TensorRules:
    """Which tensors a caller of ``as_array`` takes, and how it words a refusal.

    The checks and the view are the same for every caller; only the advice differs
    (the collectives, the torch backend and checkpoints each tell their own fix). Each
    message is a format string over ``what`` (the caller's name for the tensor),
    ``kind`` (the class of what was given), ``device``, ``layout``, ``dtype`` and
    ``error`` (what torch said).
    """

    not_tensor: str = "{what} needs a numpy.ndarray or a CPU torch.Tensor, got {kind}"
    """``TypeError``: not a ``torch.Tensor`` at all."""
    off_cpu: str = ("{what}: netdist works on CPU tensors, got one on {device}; "
                    "move it with .cpu() (and copy the result back)")
    """``TensorDeviceError``: the tensor is not on the CPU."""
    not_dense: str = ("{what}: netdist needs a dense tensor, got layout {layout}; "
                      "convert it with .to_dense()")
    """``TensorDeviceError``: the tensor is not strided (sparse, ...)."""
    dtypes: frozenset[Any] | None = None
    """The torch dtypes taken; None: every dtype NumPy can view, and bfloat16."""
    bad_dtype: str = "{what}: netdist does not take {dtype} tensors"
    """``TypeError``: the dtype is not in ``dtypes``."""
    no_view: str = "{what}: NumPy cannot view a {dtype} tensor: {error}"
    """``TypeError``: torch cannot hand the tensor's memory to NumPy."""


RULES = TensorRules()
"""The rules of netdist's own API (collectives, aggregators, parameter server, FSDP)."""


def check_tensor(obj: Any, what: str, *, writeable: bool = False,
                 rules: TensorRules = RULES) -> None:
    """Raise unless ``obj`` is a tensor whose memory ``as_array`` can view.

    ``TypeError`` if ``obj`` is not a tensor; ``TensorDeviceError`` for a tensor off the
    CPU or not dense. ``writeable=True`` also refuses (``ValueError``) a tensor whose
    elements share memory (an ``expand()``-ed view), which netdist cannot write to
    element by element. The dtype is ``as_array``'s to check.
    """
    torch = _torch()
    if torch is None or not isinstance(obj, torch.Tensor):
        raise TypeError(rules.not_tensor.format(what=what, kind=type(obj).__name__))
    if obj.device.type != "cpu":
        raise TensorDeviceError(rules.off_cpu.format(what=what, device=obj.device))
    if obj.layout is not torch.strided:
        raise TensorDeviceError(rules.not_dense.format(what=what, layout=obj.layout))
    if writeable and any(s == 0 and n > 1 for s, n in zip(obj.stride(), obj.shape)):
        raise ValueError(f"{what}: the tensor's elements overlap in memory (an expand()-ed "
                         f"view, strides {tuple(obj.stride())}); pass a tensor that owns its "
                         "elements, e.g. t.contiguous()")


def as_array(obj: Any, what: str, *, writeable: bool = False,
             rules: TensorRules = RULES) -> np.ndarray:
    """A NumPy view of the memory of CPU tensor ``obj`` (same shape and strides).

    ``what`` names the call in error messages. The tensor must pass ``check_tensor``
    (``writeable`` as there); ``TypeError`` for a dtype ``rules`` refuses or NumPy cannot
    view. bfloat16 becomes ``netdist.types.BFLOAT16`` over the same memory.
    """
    check_tensor(obj, what, writeable=writeable, rules=rules)
    torch = _torch()
    t = obj.detach()
    if rules.dtypes is not None and t.dtype not in rules.dtypes:
        raise TypeError(rules.bad_dtype.format(what=what, dtype=t.dtype))
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[no-any-return]
    try:
        return t.numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError) as exc:
        raise TypeError(rules.no_view.format(what=what, kind=type(obj).__name__,
                                             dtype=t.dtype, error=exc)) from None


def as_arrays(objs: Sequence[Any], what: str) -> list[np.ndarray]:
    """``as_array`` of every tensor in ``objs``; NumPy arrays pass through unchanged."""
    return [o if isinstance(o, np.ndarray) else as_array(o, f"{what}[{i}]")
            for i, o in enumerate(objs)]


def to_tensor(array: np.ndarray) -> Any:
    """A ``torch.Tensor`` over ``array``'s memory (``torch.from_numpy``; no copy).

    bfloat16 arrays (``ml_dtypes.bfloat16`` or ``BFLOAT16_RAW``) become
    ``torch.bfloat16`` tensors. Imports torch if it is not imported yet.
    """
    import torch

    if array.dtype.kind == "V" and is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


@dataclass(eq=False, slots=True)
class StagedOut:
    """An ``out=`` tensor as a collective fills it: ``array`` is a view of the tensor's
    memory, or of a contiguous copy that ``finish`` copies back (``copied``)."""

    tensor: Any
    array: np.ndarray
    copied: bool

    def finish(self) -> Any:
        """Copy a stand-in's contents back into the tensor; returns the tensor."""
        if self.copied:
            import torch

            with torch.no_grad():
                self.tensor.copy_(to_tensor(self.array))
        return self.tensor


def stage_out(obj: Any, what: str) -> StagedOut:
    """Prepare tensor ``obj`` to receive a collective's result (``out=``).

    A contiguous tensor is received into directly; a non-contiguous one through a
    contiguous copy that ``StagedOut.finish`` copies back.
    """
    view = as_array(obj, what, writeable=True)
    if view.flags.c_contiguous:
        return StagedOut(obj, view, False)
    return StagedOut(obj, np.ascontiguousarray(view), True)


def numpy_result(array: np.ndarray, what: str) -> Any:
    """A received array as a NumPy caller gets it.

    Only bfloat16 without ``ml_dtypes`` needs care (NumPy has no type for it): it comes
    back as a ``torch.bfloat16`` tensor where torch is imported, else as ``TypeError``
    naming the dtype and the fix, never as misread bytes.
    """
    if array.dtype.kind != "V" or array.dtype != BFLOAT16_RAW:
        return array
    if _torch() is not None:
        return to_tensor(array)
    raise TypeError(f"{what}: received bfloat16 data {list(array.shape)}, which NumPy cannot "
                    f"represent without ml_dtypes: {BF16_EXTRA_HINT} (or receive into a "
                    "torch.bfloat16 tensor with out=)")
