"""PURE top-k gradient sparsification with error feedback (Deep Gradient Compression's core).

Selection keeps the ``k = max(1, ceil(ratio * n))`` elements of largest magnitude of each
tensor, found with ``np.argpartition`` (linear time, no full sort). Ties are broken
deterministically: every element whose magnitude is strictly above the k-th largest
magnitude is kept, and among the elements *equal* to it the lowest flat indices win.
Indices come out sorted ascending. So the same input gives the same selection on every
rank, every run and every NumPy version, whatever order ``argpartition`` happens to
leave equal elements in.

Error feedback (Seide et al. 2014, Lin et al. 2018): what a step does not send stays in a
per-tensor residual and is added to the next step's gradient, so no gradient mass is
ever lost, only delayed. Over any number of steps

    sum(applied) + residual == sum(raw gradients)

holds exactly up to floating-point rounding of the additions. DGC's momentum correction
(accumulate velocity rather than gradient, and mask the momentum of sent elements) is
available with ``momentum > 0``.

Indices travel as ``int32`` when the tensor has fewer than 2**31 elements (``int64``
otherwise), so at ratio 0.01 a float32 tensor costs 0.01 * (4 + 4) / 4 = 2% of its dense
bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from netdist.compression.fp16 import float_input

__all__ = [
    "CompressedGradient",
    "TopKCompressor",
    "topk_count",
    "topk_indices",
    "index_dtype",
    "compress_gradients",
    "decompress_gradients",
]

_INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CompressedGradient:
    """The kept elements of one flattened tensor: ``flat[indices] == values``.

    ``indices`` are sorted ascending, unique, ``int32`` (``int64`` for tensors of 2**31
    elements or more); ``values`` have the gradient's dtype; ``original_len`` is the
    number of elements of the dense tensor.
    """

    indices: np.ndarray
    values: np.ndarray
    original_len: int

    @property
    def nbytes(self) -> int:
        """Bytes of indices plus values: what this tensor costs on the wire."""
        return int(self.indices.nbytes + self.values.nbytes)

    def to_dense(self, shape: Sequence[int] | None = None) -> np.ndarray:
        """A dense array (flat, or of ``shape``) with zeros where nothing was kept."""
        dense = np.zeros(self.original_len, dtype=self.values.dtype)
        dense[self.indices] = self.values
        if shape is None:
            return dense
        return dense.reshape(tuple(shape))


def _ratio_fraction(ratio: float) -> Fraction:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, Fraction)):
        raise TypeError(f"ratio must be a number, got {type(ratio).__name__}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    # 0.07 * 100 is 7.000000000000001 in binary floating point; reading the ratio as the
    # nearest simple fraction makes ceil(ratio * n) what a human expects (7, not 8).
    return Fraction(ratio).limit_denominator(10**9)


def topk_count(n: int, ratio: float | Fraction) -> int:
    """How many of ``n`` elements top-k keeps: ``max(1, ceil(ratio * n))`` (0 when n == 0)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return 0
    frac = ratio if isinstance(ratio, Fraction) else _ratio_fraction(ratio)
    return min(n, max(1, math.ceil(frac * n)))


def index_dtype(n: int) -> np.dtype[Any]:
    """``int32`` when every index of an ``n``-element tensor fits, else ``int64``."""
    return np.dtype(np.int32) if n - 1 <= _INT32_LIMIT else np.dtype(np.int64)


def topk_indices(flat: np.ndarray, k: int) -> np.ndarray:
    """Sorted flat indices of the ``k`` largest-magnitude elements of 1-D ``flat``.

    Among elements whose magnitude equals the k-th largest, the lowest indices are
    kept. Raises ``ValueError`` if ``flat`` contains NaN (its rank is undefined).
    """
    flat = np.asarray(flat)
    if flat.ndim != 1:
        raise ValueError(f"topk_indices expects a 1-D array, got shape {flat.shape}")
    n = flat.size
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    idx_dtype = index_dtype(n)
    if k == n:
        return np.arange(n, dtype=idx_dtype)
    if k == 0:
        return np.empty(0, dtype=idx_dtype)
    mag = np.abs(flat)
    part = np.argpartition(mag, n - k)
    top = part[n - k:]
    # argpartition puts NaNs last, so any NaN in the tensor is among the top k.
    if mag.dtype.kind in "fc" and np.isnan(mag[top]).any():
        raise ValueError("cannot select top-k of a gradient that contains NaN")
    threshold = mag[part[n - k]]
    above = top[mag[top] > threshold]
    need = k - above.size
    # The k - |above| lowest indices among all elements equal to the threshold.
    ties = np.flatnonzero(mag == threshold)[:need]
    result = np.concatenate([above, ties]).astype(idx_dtype, copy=False)
    result.sort()
    return result


class TopKCompressor:
    """Stateful top-k with error feedback, one residual per gradient position.

    ``compress(grads)`` is called once per step with the gradients in the same order
    (and shapes) every time; ``residuals`` holds what was not sent yet. With
    ``error_feedback=False`` it is stateless top-k. ``momentum > 0`` enables DGC's
    momentum correction: ``u = momentum * u + g``, ``v += u``, send top-k of ``v``, and
    clear both ``u`` and ``v`` where elements were sent.
    """

    def __init__(self, ratio: float, error_feedback: bool = True, momentum: float = 0.0) -> None:
        self._ratio = _ratio_fraction(ratio)
        self.ratio = float(ratio)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if momentum and not error_feedback:
            raise ValueError("momentum correction needs error_feedback=True")
        self.error_feedback = bool(error_feedback)
        self.momentum = float(momentum)
        self.residuals: list[np.ndarray] = []
        self.velocities: list[np.ndarray] = []

    def count(self, n: int) -> int:
        """Elements kept of an ``n``-element tensor."""
        return topk_count(n, self._ratio)

    def reset(self) -> None:
        """Forget all residuals (e.g. after loading parameters from a checkpoint)."""
        self.residuals = []
        self.velocities = []

    def _state_for(self, grads: Sequence[np.ndarray]) -> None:
        if self.residuals:
            if len(self.residuals) != len(grads):
                raise ValueError(f"compress got {len(grads)} gradients, the residuals hold "
                                 f"{len(self.residuals)}; call reset() when the model changes")
            for i, (r, g) in enumerate(zip(self.residuals, grads)):
                if r.size != g.size or r.dtype != g.dtype:
                    raise ValueError(f"gradient {i} is {g.dtype}[{g.size}], its residual is "
                                     f"{r.dtype}[{r.size}]; call reset() when the model changes")
            return
        self.residuals = [np.zeros(g.size, dtype=g.dtype) for g in grads]
        if self.momentum:
            self.velocities = [np.zeros(g.size, dtype=g.dtype) for g in grads]

    def compress(self, grads: Sequence[np.ndarray]) -> list[CompressedGradient]:
        """Select the top-k of each (gradient + residual); keep the rest as residual.

        The caller's arrays are not modified. Gradients may be CPU torch tensors;
        bfloat16 ones are selected in float32 (exact), so their values and residuals are
        float32.
        """
        arrays = [float_input(g, f"gradient {i}") for i, g in enumerate(grads)]
        for i, g in enumerate(arrays):
            if g.dtype.kind != "f":
                raise TypeError(f"gradient {i} has dtype {g.dtype}; top-k needs floats")
        if not self.error_feedback:
            return [self._select(g.reshape(-1)) for g in arrays]
        self._state_for(arrays)
        out = []
        for i, g in enumerate(arrays):
            acc = self.residuals[i]
            flat = g.reshape(-1)
            if self.momentum:
                u = self.velocities[i]
                u *= self.momentum
                u += flat
                acc += u
            else:
                acc += flat
            cg = self._select(acc)
            acc[cg.indices] = 0
            if self.momentum:
                self.velocities[i][cg.indices] = 0
            out.append(cg)
        return out

    def _select(self, flat: np.ndarray) -> CompressedGradient:
        idx = topk_indices(flat, self.count(flat.size))
        values = flat[idx]  # fancy indexing always copies
        return CompressedGradient(indices=idx, values=values, original_len=int(flat.size))

    def residual_norm(self) -> float:
        """L2 norm of everything not yet sent (for monitoring)."""
        return float(math.sqrt(sum(float(np.dot(r, r)) for r in self.residuals)))

    def state_dict(self) -> dict[str, Any]:
        """Residuals (and velocities) as plain arrays, for checkpoints."""
        state: dict[str, Any] = {f"residual_{i}": r.copy() for i, r in enumerate(self.residuals)}
        state.update({f"velocity_{i}": v.copy() for i, v in enumerate(self.velocities)})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by ``state_dict``."""
        residuals, velocities = [], []
        i = 0
        while f"residual_{i}" in state:
            residuals.append(np.array(state[f"residual_{i}"]).reshape(-1))
            if f"velocity_{i}" in state:
                velocities.append(np.array(state[f"velocity_{i}"]).reshape(-1))
            i += 1
        if len(state) != len(residuals) + len(velocities):
            raise ValueError("unexpected keys in top-k compressor state")
        if velocities and len(velocities) != len(residuals):
            raise ValueError("top-k compressor state has velocities for only some tensors")
        if bool(velocities) != bool(self.momentum) and residuals:
            raise ValueError("top-k compressor state does not match the momentum setting")
        self.residuals, self.velocities = residuals, velocities


def compress_gradients(grads: Sequence[np.ndarray], ratio: float) -> list[CompressedGradient]:
    """Stateless top-k of each gradient (no error feedback), flattened."""
    return TopKCompressor(ratio, error_feedback=False).compress(grads)


def decompress_gradients(compressed: Sequence[CompressedGradient],
                         shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Dense arrays of ``shapes`` with each tensor's kept values in place, zeros elsewhere."""
    if len(compressed) != len(shapes):
        raise ValueError(f"{len(compressed)} compressed gradients but {len(shapes)} shapes")
    out = []
    for i, (cg, shape) in enumerate(zip(compressed, shapes)):
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != cg.original_len:
            raise ValueError(f"gradient {i}: shape {shape} does not hold "
                             f"{cg.original_len} elements")
        out.append(cg.to_dense(shape))
    return out
