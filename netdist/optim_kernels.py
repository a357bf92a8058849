"""PURE in-place SGD and Adam update kernels on plain NumPy arrays (torch semantics).

One copy of the update arithmetic shared by every optimizer in netdist, through
``netdist.optim`` (the configs, the per-array step and the shard optimizer that the local
optimizers of ``netdist.train.optimizers``, the sharded FSDP optimizers of
``netdist.parallel.sharded_optim`` and the parameter servers use). Keeping the operation
order in one place is what makes those three produce bitwise-identical trajectories,
which their equivalence tests rely on.

The formulas follow ``torch.optim.SGD`` and ``torch.optim.Adam`` (non-foreach reference
path) step for step. This module sits at the bottom layer: it imports only NumPy.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["sgd_update", "adam_update", "check_lr", "check_sgd_hyperparameters",
           "check_adam_hyperparameters"]


def check_lr(lr: float) -> None:
    """Raise ``ValueError`` unless the learning rate is >= 0 (NaN refused)."""
    if not lr >= 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")


def check_sgd_hyperparameters(*, momentum: float, nesterov: bool, weight_decay: float,
                              dampening: float) -> None:
    """Raise ``ValueError`` for SGD hyper-parameters torch would refuse (lr aside)."""
    if not momentum >= 0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires momentum > 0 and dampening == 0")


def check_adam_hyperparameters(*, beta1: float, beta2: float, eps: float,
                               weight_decay: float) -> None:
    """Raise ``ValueError`` for Adam hyper-parameters torch would refuse (lr aside)."""
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def sgd_update(param: np.ndarray, grad: np.ndarray, momentum_buffer: np.ndarray | None, *,
               lr: float, momentum: float, nesterov: bool, weight_decay: float,
               dampening: float = 0.0, first_step: bool | None = None,
               scratch: np.ndarray | None = None) -> np.ndarray | None:
    """One SGD step on ``param`` in place; returns the momentum buffer (None without momentum).

    ``d = grad + weight_decay * param``; with momentum the buffer becomes ``d`` on the
    first step, then ``buf = momentum * buf + (1 - dampening) * d``; ``d = d + momentum *
    buf`` (Nesterov) or ``d = buf``; finally ``param -= lr * d``.

    ``momentum_buffer`` is updated in place when given; when it is None and momentum is
    on, a new buffer (a copy of ``d`` in ``param``'s dtype) is allocated and returned.
    ``first_step`` defaults to ``momentum_buffer is None``; pass it explicitly when the
    caller pre-allocates the buffer (its contents are then overwritten on the first step).
    ``scratch`` (shaped and typed like ``param``) lets the products land in a reused array
    instead of a fresh temporary each step; the result is the same when ``grad`` has
    ``param``'s dtype.
    """
    d = grad
    if weight_decay != 0:
        d = d + weight_decay * param
    buf = momentum_buffer
    if momentum != 0:
        if first_step is None:
            first_step = buf is None
        if buf is None:
            buf = np.array(d, dtype=param.dtype, copy=True)
        elif first_step:
            buf[...] = d
        if not first_step:
            buf *= momentum
            if scratch is None:
                buf += (1 - dampening) * d
            else:
                buf += np.multiply(d, 1 - dampening, out=scratch)
        d = d + momentum * buf if nesterov else buf
    if scratch is None:
        param -= lr * d
    else:
        param -= np.multiply(d, lr, out=scratch)
    return buf


def adam_update(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray,
                exp_avg_sq: np.ndarray, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float,
                max_exp_avg_sq: np.ndarray | None = None) -> None:
    """One Adam step on ``param`` in place, updating the moment arrays in place.

    ``g = grad + weight_decay * param``; ``m = beta1 * m + (1 - beta1) * g``;
    ``v = beta2 * v + (1 - beta2) * g * g``;
    ``param -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)``.
    ``step`` is 1-based. Passing ``max_exp_avg_sq`` turns on AMSGrad: its running
    maximum of ``v`` (kept in place) replaces ``v`` in the denominator.
    """
    g = grad
    if weight_decay != 0:
        g = g + weight_decay * param
    m = exp_avg
    v = exp_avg_sq
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * (g * g)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    if max_exp_avg_sq is not None:
        np.maximum(max_exp_avg_sq, v, out=max_exp_avg_sq)
        v = max_exp_avg_sq
    denom = np.sqrt(v) / math.sqrt(bias_correction2) + eps
    param -= (lr / bias_correction1) * (m / denom)
