"""PURE outer optimizers for DiLoCo: what the averaged outer gradient does to the global model.

DiLoCo (Douillard et al. 2023) treats ``global - local`` after ``H`` inner steps, averaged
over the workers, as a gradient (the *outer gradient*) and applies it to the global model
with an outer optimizer; SGD with Nesterov momentum (lr 0.7, momentum 0.9) is the
published recipe and the default here. ``OuterSGD`` computes what
``torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)`` computes (torch fuses
``a + alpha * b`` into one rounding where NumPy rounds twice, so the two agree to an ulp,
not bitwise), element by element in the parameters' dtype:

    buf = momentum * buf + g          (buf starts at zero, so the first buf is g)
    d   = g + momentum * buf          (nesterov; plain momentum: d = buf)
    p   = p - lr * d

Every rank holds the same global model and momentum and receives the same averaged outer
gradient (bitwise: the all-reduce guarantees it), and these are elementwise NumPy
operations in a fixed order, so every rank computes the same new global model bit for bit
without exchanging it.

``lr=1, momentum=0`` makes the outer step ``p - (p - mean(local)) = mean(local)`` up to one
rounding: that is LocalSGD (``netdist.parallel.diloco.LocalSGD`` averages the parameters
directly instead, which is exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from netdist.errors import ConfigError

__all__ = ["OuterOptimizer", "OuterSGD"]


class OuterOptimizer(Protocol):
    """What DiLoCo needs of an outer optimizer: update ``params`` in place from ``grads``.

    ``key`` names the parameter group (a fragment), so one optimizer can keep state for
    several fragments that are stepped at different times.
    """

    def step(self, key: str, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@dataclass
class OuterSGD:
    """SGD with (Nesterov) momentum over NumPy arrays; see the module docstring."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    _buffers: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"outer lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("nesterov needs momentum > 0 (torch.optim.SGD's rule)")

    def step(self, key: str, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        """``params[i] -= lr * d_i`` in place (``d`` per the module docstring)."""
        if len(params) != len(grads):
            raise ConfigError(f"outer step {key!r}: {len(params)} parameters but "
                              f"{len(grads)} gradients")
        if self.momentum == 0:
            for p, g in zip(params, grads):
                p -= p.dtype.type(self.lr) * g
            return
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = [np.zeros_like(p) for p in params]
        elif [b.shape for b in buffers] != [p.shape for p in params]:
            raise ConfigError(f"outer step {key!r}: parameter shapes "
                              f"{[p.shape for p in params]} differ from the momentum's "
                              f"{[b.shape for b in buffers]}")
        for p, g, buf in zip(params, grads, buffers):
            m = p.dtype.type(self.momentum)
            buf *= m
            buf += g
            d = g + m * buf if self.nesterov else buf
            p -= p.dtype.type(self.lr) * d

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and momentum buffers (copies), as plain data."""
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "buffers": {k: [b.copy() for b in bufs] for k, bufs in self._buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (buffers are copied in)."""
        for name in ("lr", "momentum", "nesterov"):
            if name in state and state[name] != getattr(self, name):
                raise ConfigError(f"outer optimizer state has {name}={state[name]!r}, "
                                  f"this optimizer {getattr(self, name)!r}")
        self._buffers = {k: [np.array(b, copy=True) for b in bufs]
                         for k, bufs in state.get("buffers", {}).items()}

    def adopt_buffers(self, key: str, arrays: Sequence[np.ndarray]) -> None:
        """Use ``arrays`` (live, updated in place) as the momentum buffers of ``key``.

        For state kept elsewhere, e.g. an elastic job's ``ElasticState``: the arrays are
        not copied, so what the owner loads into them is the momentum the next step uses.
        Zeros are the state before the first step. ``load_state_dict`` replaces them with
        copies (the link is then gone).
        """
        buffers = list(arrays)
        for i, b in enumerate(buffers):
            if not isinstance(b, np.ndarray):
                raise ConfigError(f"outer momentum {key!r}[{i}] must be a numpy.ndarray, "
                                  f"got {type(b).__name__}")
            if not b.flags.writeable:
                raise ConfigError(f"outer momentum {key!r}[{i}] is read-only")
        self._buffers[key] = buffers

    def buffers(self, key: str) -> list[np.ndarray] | None:
        """The momentum buffers of ``key`` (live arrays; None before its first step)."""
        return self._buffers.get(key)
