"""Optimizers over flat shard arrays: each rank updates only the elements it owns.

``ShardedSGD`` and ``ShardedAdam`` apply, element by element, exactly the update rules of
``netdist.train.optim.SGD`` / ``Adam`` (which follow ``torch.optim``), so a model trained
with FSDP and a sharded optimizer follows the single-process trajectory up to the
rounding of the gradient reduction. FSDP hands them 1-D views of a unit's local shard --
real elements only, padding excluded -- and the state arrays it allocated for that shard
(``state_keys()`` says which), so optimizer state is sharded like the parameters: ZeRO-1
by construction. This module never imports ``netdist.train``; ``sharded_optimizer_from`` reads a
``netdist.train`` optimizer's ``hyperparameters()`` to build the matching sharded one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ShardedOptimizer", "ShardedSGD", "ShardedAdam", "sharded_optimizer_from"]


class ShardedOptimizer:
    """Base class: hyper-parameters and a step counter; state arrays live with FSDP.

    ``update(param, grad, state, step)`` updates ``param`` in place from ``grad``;
    ``state`` maps each of ``state_keys()`` to an array shaped like ``param`` that FSDP
    allocated (zero-filled) before the first update, and ``step`` is the 1-based number
    of the step being taken (``first`` steps are ``step == 1`` for that state).
    """

    _hyper_names: tuple[str, ...] = ()

    def __init__(self, lr: float) -> None:
        if not lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def state_keys(self) -> tuple[str, ...]:
        """Names of the per-element state arrays this optimizer keeps."""
        return ()

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, Any]:
        """Current hyper-parameters as plain floats/bools (same names as netdist.train)."""
        return {name: getattr(self, name) for name in self._hyper_names}

    def load_hyperparameters(self, hyper: Mapping[str, Any]) -> None:
        """Set hyper-parameters from a ``hyperparameters()`` dict (unknown keys refused)."""
        for key in hyper:
            if key not in self._hyper_names:
                raise ValueError(f"unknown hyper-parameter {key!r} for {type(self).__name__}")
        for key, value in hyper.items():
            setattr(self, key, type(getattr(self, key))(value))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class ShardedSGD(ShardedOptimizer):
    """SGD with torch's momentum, dampening, Nesterov and L2 weight decay, per element.

    ``d = grad + weight_decay * p``; with momentum ``buf = d`` on the first step, then
    ``buf = momentum * buf + (1 - dampening) * d``; ``d = d + momentum * buf`` (Nesterov)
    or ``d = buf``; finally ``p -= lr * d``.
    """

    _hyper_names = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, dampening: float = 0.0) -> None:
        super().__init__(lr)
        if not momentum >= 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening == 0")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.dampening = float(dampening)

    def state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        d = grad
        if self.weight_decay != 0:
            d = d + self.weight_decay * param
        if self.momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                buf[...] = d
            else:
                buf *= self.momentum
                buf += (1 - self.dampening) * d
            d = d + self.momentum * buf if self.nesterov else buf
        param -= self.lr * d


class ShardedAdam(ShardedOptimizer):
    """Adam with torch's bias correction, L2 ``weight_decay`` and optional AMSGrad.

    ``g = grad + weight_decay * p``; ``m = beta1 m + (1 - beta1) g``;
    ``v = beta2 v + (1 - beta2) g^2``;
    ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    """

    _hyper_names = ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(lr)
        beta1, beta2 = betas
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.amsgrad = bool(amsgrad)

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def state_keys(self) -> tuple[str, ...]:
        keys = ("exp_avg", "exp_avg_sq")
        return keys + ("max_exp_avg_sq",) if self.amsgrad else keys

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        g = grad
        if self.weight_decay != 0:
            g = g + self.weight_decay * param
        m = state["exp_avg"]
        v = state["exp_avg_sq"]
        m *= self.beta1
        m += (1 - self.beta1) * g
        v *= self.beta2
        v += (1 - self.beta2) * (g * g)
        bias_correction1 = 1 - self.beta1 ** step
        bias_correction2 = 1 - self.beta2 ** step
        if self.amsgrad:
            vmax = state["max_exp_avg_sq"]
            np.maximum(vmax, v, out=vmax)
            v = vmax
        denom = np.sqrt(v) / math.sqrt(bias_correction2) + self.eps
        param -= (self.lr / bias_correction1) * (m / denom)


def sharded_optimizer_from(optimizer: Any) -> ShardedOptimizer:
    """The sharded twin of a ``netdist.train`` ``SGD``/``Adam`` (same hyper-parameters).

    Reads ``optimizer.hyperparameters()``; raises ``TypeError`` for anything else. Its
    per-parameter state is not carried over (build FSDP before the first step).
    """
    getter = getattr(optimizer, "hyperparameters", None)
    if not callable(getter):
        raise TypeError(f"{type(optimizer).__name__} has no hyperparameters(); pass a "
                        "netdist.train SGD or Adam, or build ShardedSGD/ShardedAdam directly")
    hyper = dict(getter())
    names = set(hyper)
    if names == set(ShardedSGD._hyper_names):
        return ShardedSGD(hyper["lr"], momentum=hyper["momentum"], nesterov=hyper["nesterov"],
                          weight_decay=hyper["weight_decay"], dampening=hyper["dampening"])
    if names == set(ShardedAdam._hyper_names):
        return ShardedAdam(hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                           eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                           amsgrad=hyper["amsgrad"])
    raise TypeError(f"cannot build a sharded optimizer from {type(optimizer).__name__} "
                    f"with hyper-parameters {sorted(names)}")
