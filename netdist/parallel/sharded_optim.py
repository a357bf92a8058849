"""Optimizers over flat shard arrays: each rank updates only the elements it owns.

``ShardedSGD`` and ``ShardedAdam`` apply, element by element, exactly the update rules of
``netdist.train.optim.SGD`` / ``Adam`` (which follow ``torch.optim``), so a model trained
with FSDP and a sharded optimizer follows the single-process trajectory up to the
rounding of the gradient reduction. FSDP hands them 1-D views of a unit's local shard --
real elements only, padding excluded -- and the state arrays it allocated for that shard
(``state_keys()`` says which), so optimizer state is sharded like the parameters: ZeRO-1
by construction. This module never imports ``netdist.train``; ``sharded_optimizer_from`` reads a
``netdist.train`` optimizer's ``hyperparameters()`` to build the matching sharded one.

bfloat16 shards (FSDP over bfloat16 parameters, with or without ``ml_dtypes``): ``apply``
widens the parameter, gradient and state to float32 (exactly), runs the same update in
float32 and rounds the parameter and the state back to bfloat16 (nearest even, as torch
rounds) once per step; the state stays bfloat16 between steps, as torch keeps an
optimizer's state in the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from netdist.optim_kernels import (AdamHyperparameters, adam_update, check_lr,
                                    check_sgd_hyperparameters, sgd_update)
from netdist.types import bfloat16_to_float32, float32_to_bfloat16, is_bfloat16

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
        check_lr(lr)
        self.lr = float(lr)

    def state_keys(self) -> tuple[str, ...]:
        """Names of the per-element state arrays this optimizer keeps."""
        return ()

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        raise NotImplementedError

    def apply(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
              step: int) -> None:
        """``update``, for any floating dtype FSDP holds: bfloat16 (which NumPy cannot
        compute with) is updated in float32 and rounded back once (module docstring)."""
        if not is_bfloat16(param.dtype):
            self.update(param, grad, state, step)
            return
        wide = {key: bfloat16_to_float32(value) for key, value in state.items()}
        param32 = bfloat16_to_float32(param)
        self.update(param32, bfloat16_to_float32(grad), wide, step)
        float32_to_bfloat16(param32, out=param)
        for key, value in state.items():
            float32_to_bfloat16(wide[key], out=value)

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
        check_sgd_hyperparameters(momentum=momentum, nesterov=nesterov,
                                  weight_decay=weight_decay, dampening=dampening)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.dampening = float(dampening)

    def state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        sgd_update(param, grad, state["momentum_buffer"] if self.momentum != 0 else None,
                   lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                   weight_decay=self.weight_decay, dampening=self.dampening,
                   first_step=step == 1)


class ShardedAdam(AdamHyperparameters, ShardedOptimizer):
    """Adam with torch's bias correction, L2 ``weight_decay`` and optional AMSGrad.

    ``g = grad + weight_decay * p``; ``m = beta1 m + (1 - beta1) g``;
    ``v = beta2 v + (1 - beta2) g^2``;
    ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    """

    _hyper_names = ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(lr)
        self._set_adam_hyperparameters(betas, eps, weight_decay, amsgrad)

    def state_keys(self) -> tuple[str, ...]:
        keys = ("exp_avg", "exp_avg_sq")
        return keys + ("max_exp_avg_sq",) if self.amsgrad else keys

    def update(self, param: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray],
               step: int) -> None:
        adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=self.lr,
                    beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=self.weight_decay,
                    max_exp_avg_sq=state["max_exp_avg_sq"] if self.amsgrad else None)


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
