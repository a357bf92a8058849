"""SGD and Adam with torch's update rules, updating ``param.data`` in place.

The update formulas follow ``torch.optim.SGD`` and ``torch.optim.Adam`` (non-foreach
reference path) step for step, so a model trained here and the same model trained with
torch follow the same trajectory up to floating-point rounding. The hyper-parameters are
a ``netdist.optim`` config (``optimizer.config``; ``optimizer.lr`` and friends read and
write it) and every step is ``netdist.optim.update``: the same vocabulary and arithmetic
as the FSDP and parameter-server optimizers.

``state_dict()`` holds only plain data -- nested ``dict``s with ``str`` keys whose leaves
are NumPy arrays, ``int``, ``float`` or ``bool`` -- so the checkpoint layer can write it
without pickle. Per-parameter state is keyed by ``Parameter.name`` (names must therefore
be unique within one optimizer) and is created lazily on the first step, as in torch.

Parameters are updated in place (``param.data -= ...``), whatever array ``param.data``
points at when ``step()`` runs; FSDP relies on that to step a local shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from netdist.optim import (
    AdamAttributes,
    AdamConfig,
    OptimizerConfig,
    SGDAttributes,
    SGDConfig,
    update,
)
from netdist.train.nn import Parameter

__all__ = ["Optimizer", "SGD", "Adam"]

StateDict = dict[str, Any]


class Optimizer:
    """Common parts: the parameter list, per-parameter state, ``zero_grad``, state dicts."""

    config: OptimizerConfig

    def __init__(self, params: Iterable[Parameter], config: OptimizerConfig) -> None:
        self.params: list[Parameter] = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        names = [p.name for p in self.params]
        for p in self.params:
            if not isinstance(p, Parameter):
                raise TypeError(f"optimizer parameters must be Parameter, got {type(p).__name__}")
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameter names must be unique within an optimizer: {dupes}")
        self.config = config
        self.state: dict[str, dict[str, Any]] = {}

    def zero_grad(self) -> None:
        """Zero every parameter's gradient in place."""
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """Apply one update from each ``param.grad`` to ``param.data`` in place."""
        for p in self.params:
            if p.grad.shape != p.data.shape:
                raise ValueError(f"parameter {p.name!r}: grad shape {p.grad.shape} "
                                 f"differs from data shape {p.data.shape}")
            state = self.state.setdefault(p.name, {})
            step = None  # torch's SGD counts no steps; Adam keeps "step" in the state
            if isinstance(self.config, AdamConfig):
                step = state["step"] = int(state.get("step", 0)) + 1
            update(self.config, p.data, p.grad, state, step)

    def hyperparameters(self) -> dict[str, Any]:
        """Current hyper-parameters as plain floats/bools."""
        return self.config.hyperparameters()

    def state_dict(self) -> StateDict:
        """``{"hyperparams": {...}, "state": {param name: {key: array | int}}}``, copied."""
        state = {name: {key: (value.copy() if isinstance(value, np.ndarray) else value)
                        for key, value in entry.items()}
                 for name, entry in self.state.items()}
        return {"hyperparams": self.hyperparameters(), "state": state}

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore hyper-parameters and per-parameter state (arrays are copied).

        Every state entry must name one of this optimizer's parameters and carry arrays
        of that parameter's shape; hyper-parameters missing from ``state_dict`` keep their
        current values.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError("optimizer state dict must be a dict with a 'state' entry")
        by_name = {p.name: p for p in self.params}
        new_state: dict[str, dict[str, Any]] = {}
        for name, entry in state_dict["state"].items():
            if name not in by_name:
                raise ValueError(f"optimizer state names unknown parameter {name!r}")
            new_state[name] = self._restored(name, by_name[name], entry)
        config = self.config.with_hyperparameters(state_dict.get("hyperparams", {}),
                                                  type(self).__name__)
        self.config = config
        self.state = new_state

    def _restored(self, name: str, p: Parameter, entry: dict[str, Any]) -> dict[str, Any]:
        """One parameter's saved state, checked against ``p`` and copied."""
        restored: dict[str, Any] = {}
        for key, value in entry.items():
            if key in self.config.STATE_KEYS:
                array = np.asarray(value)
                if array.shape != p.data.shape:
                    raise ValueError(f"optimizer state {name}.{key}: shape {array.shape}, "
                                     f"parameter has {p.data.shape}")
                restored[key] = array.astype(p.data.dtype, copy=True)
            elif key == "step":
                restored[key] = int(value)
            else:
                raise ValueError(f"unknown optimizer state key {key!r} for {name!r}")
        return restored


class SGD(SGDAttributes, Optimizer):
    """Stochastic gradient descent with torch's momentum, Nesterov and weight decay.

    ``d = grad + weight_decay * p``; with momentum ``buf = d`` on the first step, then
    ``buf = momentum * buf + (1 - dampening) * d``; ``d = d + momentum * buf`` (Nesterov)
    or ``d = buf``; finally ``p -= lr * d``.
    """

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0,
                 dampening: float = 0.0) -> None:
        super().__init__(params, SGDConfig(lr, momentum, nesterov, weight_decay, dampening))


class Adam(AdamAttributes, Optimizer):
    """Adam with torch's bias correction and L2 ``weight_decay`` (added to the gradient).

    Per parameter: ``step += 1``; ``g = grad + weight_decay * p``;
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)``.
    With ``amsgrad`` the running maximum of ``v`` replaces ``v`` in the denominator.
    """

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        beta1, beta2 = betas
        super().__init__(params, AdamConfig(lr, beta1, beta2, eps, weight_decay, amsgrad))
