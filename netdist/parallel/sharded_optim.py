"""Optimizers over flat shard arrays: each rank updates only the elements it owns.

``ShardedSGD`` and ``ShardedAdam`` apply, element by element, exactly the update rules of
``netdist.train.optimizers.SGD`` / ``Adam`` (which follow ``torch.optim``): their
hyper-parameters are a ``netdist.optim`` config and every step is ``netdist.optim.update``,
so a model trained with FSDP and a sharded optimizer follows the single-process
trajectory up to the rounding of the gradient reduction. FSDP hands them 1-D views of a
unit's local shard -- real elements only, padding excluded -- and the state arrays it
allocated for that shard (``state_keys()`` says which), so optimizer state is sharded like
the parameters: ZeRO-1 by construction. This module never imports ``netdist.train``;
``sharded_optimizer_from`` reads a ``netdist.train`` optimizer's ``hyperparameters()`` to
build the matching sharded one.

bfloat16 shards (FSDP over bfloat16 parameters, with or without ``ml_dtypes``): ``apply``
runs ``netdist.optim.update_widened`` -- the same update in float32, the parameter and the
state rounded back to bfloat16 (nearest even, as torch rounds) once per step; the state
stays bfloat16 between steps, as torch keeps an optimizer's state in the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from netdist.optim import (
    AdamAttributes,
    AdamConfig,
    OptimizerConfig,
    SGDAttributes,
    SGDConfig,
    config_from_hyperparameters,
    update,
    update_widened,
)
from netdist.types import is_bfloat16

__all__ = ["ShardedOptimizer", "ShardedSGD", "ShardedAdam", "sharded_optimizer_from"]


class ShardedOptimizer:
    """Base class: a ``netdist.optim`` config; state arrays and the step count live with FSDP.

    ``update(param, grad, state, step)`` updates ``param`` in place from ``grad``;
    ``state`` maps each of ``state_keys()`` to an array shaped like ``param`` that FSDP
    allocated (zero-filled) before the first update, and ``step`` is the 1-based number
    of the step being taken (``first`` steps are ``step == 1`` for that state).
    """

    config: OptimizerConfig

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config

    def state_keys(self) -> tuple[str, ...]:
        """Names of the per-element state arrays this optimizer keeps."""
        return self.config.state_keys()

    def update(self, param: np.ndarray, grad: np.ndarray, state: MutableMapping[str, np.ndarray],
               step: int) -> None:
        update(self.config, param, grad, state, step)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: MutableMapping[str, np.ndarray],
              step: int) -> None:
        """``update``, for any floating dtype FSDP holds: bfloat16 (which NumPy cannot
        compute with) is updated in float32 and rounded back once (module docstring)."""
        if is_bfloat16(param.dtype):
            update_widened(self.config, param, grad, state, step)
        else:
            update(self.config, param, grad, state, step)

    def hyperparameters(self) -> dict[str, Any]:
        """Current hyper-parameters as plain floats/bools (same names as netdist.train)."""
        return self.config.hyperparameters()

    def load_hyperparameters(self, hyper: Mapping[str, Any]) -> None:
        """Set hyper-parameters from a ``hyperparameters()`` dict (unknown keys refused)."""
        self.config = self.config.with_hyperparameters(hyper, type(self).__name__)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class ShardedSGD(SGDAttributes, ShardedOptimizer):
    """SGD with torch's momentum, dampening, Nesterov and L2 weight decay, per element
    (``netdist.optim.SGDConfig`` gives the rule)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, dampening: float = 0.0) -> None:
        super().__init__(SGDConfig(lr, momentum, nesterov, weight_decay, dampening))


class ShardedAdam(AdamAttributes, ShardedOptimizer):
    """Adam with torch's bias correction, L2 ``weight_decay`` and optional AMSGrad, per
    element (``netdist.optim.AdamConfig`` gives the rule)."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        beta1, beta2 = betas
        super().__init__(AdamConfig(lr, beta1, beta2, eps, weight_decay, amsgrad))


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
    config = config_from_hyperparameters(hyper)
    if isinstance(config, SGDConfig):
        return ShardedSGD(config.lr, momentum=config.momentum, nesterov=config.nesterov,
                          weight_decay=config.weight_decay, dampening=config.dampening)
    if isinstance(config, AdamConfig):
        return ShardedAdam(config.lr, betas=config.betas, eps=config.eps,
                           weight_decay=config.weight_decay, amsgrad=config.amsgrad)
    raise TypeError(f"cannot build a sharded optimizer from {type(optimizer).__name__} "
                    f"with hyper-parameters {sorted(hyper)}")
