"""PURE optimizer vocabulary shared by the three optimizer front-ends of netdist.

netdist holds parameters three ways, so it has three optimizer front-ends:

- ``netdist.train.optimizers`` (``SGD``, ``Adam``): a model's ``Parameter`` objects, with
  per-parameter state created on the first step, as ``torch.optim`` does;
- ``netdist.parallel.sharded_optim`` (``ShardedSGD``, ``ShardedAdam``): the flat shards
  FSDP owns, with state arrays FSDP allocates next to them (ZeRO-1);
- ``netdist.ps``: an ``SGDConfig`` / ``AdamConfig`` sent to the servers, each of which runs
  a ``ShardOptimizer`` on its flat shard.

Everything but the holding lives here, once:

- ``SGDConfig`` / ``AdamConfig``: checked, frozen hyper-parameters with torch's names and
  defaults (Adam's ``betas`` as ``beta1`` / ``beta2``) and their two plain-data forms:
  ``to_dict()`` (tagged with the rule's name; what the parameter server's wire carries,
  read back by ``optimizer_config_from_dict``) and ``hyperparameters()`` (the flat dict
  optimizer state dicts carry, read back by ``config_from_hyperparameters``);
- ``update(config, param, grad, state, step)``: one step on one array and its state;
  ``update_widened`` does it for bfloat16 in float32, rounding back once;
- ``ShardOptimizer``: a config, its state and a step counter over one flat shard;
- ``ConfigField`` and the ``SGDAttributes`` / ``AdamAttributes`` mixins: ``opt.lr``,
  ``opt.momentum``, ... on a front-end whose hyper-parameters are one config.

The arithmetic is ``netdist.optim_kernels``' (torch's update rules, operation for
operation). One copy of it, one validation and one state layout are what make the three
front-ends follow bitwise-identical trajectories, which their equivalence tests check.
This module sits in the bottom layer: it imports NumPy and other bottom-layer modules only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar, overload

import numpy as np

from netdist.optim_kernels import (
    adam_update,
    check_adam_hyperparameters,
    check_lr,
    check_sgd_hyperparameters,
    sgd_update,
)
from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.types import is_bfloat16

__all__ = [
    "SGDConfig",
    "AdamConfig",
    "OptimizerConfig",
    "optimizer_config_from_dict",
    "config_from_hyperparameters",
    "update",
    "update_widened",
    "ShardOptimizer",
    "ConfigField",
    "SGDAttributes",
    "AdamAttributes",
]


def _coerce_fields(config: Any) -> None:
    """Store every field of a (checked) config as ``float`` or ``bool``, its declared type,
    so ``SGDConfig(lr=1)`` and ``SGDConfig(lr=1.0)`` are the same plain data."""
    for field in dataclasses.fields(config):
        cast = bool if field.type == "bool" else float
        object.__setattr__(config, field.name, cast(getattr(config, field.name)))


class _ConfigForms:
    """The plain-data forms shared by both configs (``to_dict``, ``hyperparameters``)."""

    __slots__ = ()
    rule: ClassVar[str]
    """The update rule's name in ``to_dict()`` (``"sgd"``, ``"adam"``)."""
    HYPERPARAMETERS: ClassVar[tuple[str, ...]]
    """The keys of ``hyperparameters()``, in the order state dicts list them."""
    STATE_KEYS: ClassVar[tuple[str, ...]]
    """Every per-element state array the rule may keep (``state_keys()`` says which this
    config keeps)."""

    def to_dict(self) -> dict[str, Any]:
        """``{"name": rule, field: value, ...}`` (msgpack- and JSON-able)."""
        return {"name": self.rule, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def hyperparameters(self) -> dict[str, Any]:
        """The hyper-parameters as plain floats/bools, keyed as state dicts key them."""
        return {name: getattr(self, name) for name in self.HYPERPARAMETERS}

    def with_hyperparameters(self, hyper: Mapping[str, Any], owner: str) -> Self:
        """A copy with ``hyper`` (a subset of ``hyperparameters()``) applied and checked;
        ``ValueError`` naming ``owner`` for a key this rule does not have."""
        for key in hyper:
            if key not in self.HYPERPARAMETERS:
                raise ValueError(f"unknown hyper-parameter {key!r} for {owner}")
        return dataclasses.replace(self, **hyper)  # type: ignore[type-var]


@dataclass(frozen=True, slots=True)
class SGDConfig(_ConfigForms):
    """SGD with torch's momentum, Nesterov, dampening and L2 weight decay.

    ``d = grad + weight_decay * p``; with momentum ``buf = d`` on the first step, then
    ``buf = momentum * buf + (1 - dampening) * d``; ``d = d + momentum * buf`` (Nesterov)
    or ``d = buf``; finally ``p -= lr * d``.
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0

    rule: ClassVar[str] = "sgd"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = (
        "lr", "momentum", "dampening", "weight_decay", "nesterov")
    STATE_KEYS: ClassVar[tuple[str, ...]] = ("momentum_buffer",)

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_sgd_hyperparameters(momentum=self.momentum, nesterov=self.nesterov,
                                  weight_decay=self.weight_decay, dampening=self.dampening)
        _coerce_fields(self)

    def state_keys(self) -> tuple[str, ...]:
        """The state arrays this config keeps: the momentum buffer, with momentum."""
        return self.STATE_KEYS if self.momentum != 0 else ()


@dataclass(frozen=True, slots=True)
class AdamConfig(_ConfigForms):
    """Adam with torch's bias correction, L2 ``weight_decay`` and optional AMSGrad.

    ``g = grad + weight_decay * p``; ``m = beta1 * m + (1 - beta1) * g``;
    ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)``.
    With ``amsgrad`` the running maximum of ``v`` replaces ``v`` in the denominator.
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    rule: ClassVar[str] = "adam"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = (
        "lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad")
    STATE_KEYS: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_adam_hyperparameters(beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                   weight_decay=self.weight_decay)
        _coerce_fields(self)

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def state_keys(self) -> tuple[str, ...]:
        """The state arrays this config keeps: both moments, and the maximum with AMSGrad."""
        return self.STATE_KEYS if self.amsgrad else self.STATE_KEYS[:2]


OptimizerConfig = SGDConfig | AdamConfig

_CONFIGS: tuple[type[SGDConfig] | type[AdamConfig], ...] = (SGDConfig, AdamConfig)


def optimizer_config_from_dict(value: Any) -> OptimizerConfig:
    """Rebuild an optimizer config from ``to_dict()`` output; ``ValueError`` if malformed."""
    by_rule = {cls.rule: cls for cls in _CONFIGS}
    if not isinstance(value, Mapping) or value.get("name") not in by_rule:
        raise ValueError(f"malformed optimizer config {value!r}")
    cls = by_rule[value["name"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - fields - {"name"}
    if unknown:
        raise ValueError(f"unknown {value['name']} option(s) {sorted(unknown)}")
    try:
        return cls(**{k: v for k, v in value.items() if k != "name"})
    except TypeError as exc:
        raise ValueError(f"malformed optimizer config {value!r}: {exc}") from None


def config_from_hyperparameters(hyper: Mapping[str, Any]) -> OptimizerConfig | None:
    """The config whose ``hyperparameters()`` are ``hyper`` (recognised by its exact key
    set), or None when no rule has those keys. Values are checked as the constructor
    checks them."""
    for cls in _CONFIGS:
        if set(hyper) == set(cls.HYPERPARAMETERS):
            return cls(**hyper)
    return None


# -- one step on one array ------------------------------------------------------------------


def update(config: OptimizerConfig, param: np.ndarray, grad: np.ndarray,
           state: MutableMapping[str, Any], step: int | None, *,
           scratch: np.ndarray | None = None) -> None:
    """One step of ``config``'s rule on ``param`` (in place), ``state`` holding its history.

    ``state`` maps the arrays of ``config.state_keys()`` (shaped like ``param``) by name,
    in torch's layout; arrays missing from it are created and added here -- Adam's
    moments zero-filled, SGD's momentum buffer as a copy of the first direction, as torch
    creates them -- and other entries (``netdist.train`` keeps ``"step"`` there, as torch
    does) are left alone.

    ``step`` is the 1-based number of this update. Adam's bias correction needs it; for
    SGD, step 1 means a momentum buffer already in ``state`` holds no history yet (FSDP
    allocates state before the first step, so that an in-place checkpoint load has
    somewhere to land) and is overwritten rather than decayed. ``None`` is for SGD
    callers that count no steps (``netdist.train.SGD``, like ``torch.optim.SGD``): the
    buffer's presence alone then marks a step after the first.

    ``scratch`` (shaped and typed like ``param``) spares SGD a temporary per product;
    the result is the same bits when ``grad`` has ``param``'s dtype.
    """
    if isinstance(config, SGDConfig):
        buf = state.get("momentum_buffer")
        first = buf is None or step == 1
        new = sgd_update(param, grad, buf, lr=config.lr, momentum=config.momentum,
                         nesterov=config.nesterov, weight_decay=config.weight_decay,
                         dampening=config.dampening, first_step=first, scratch=scratch)
        if new is not None:
            state["momentum_buffer"] = new
        return
    if step is None:
        raise ValueError("an Adam update needs its step number (1-based)")
    for key in config.state_keys():
        if key not in state:
            state[key] = np.zeros_like(param)
    adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=config.lr,
                beta1=config.beta1, beta2=config.beta2, eps=config.eps,
                weight_decay=config.weight_decay,
                max_exp_avg_sq=state["max_exp_avg_sq"] if config.amsgrad else None)


def update_widened(config: OptimizerConfig, param: np.ndarray, grad: np.ndarray,
                   state: MutableMapping[str, Any], step: int | None) -> None:
    """``update`` for bfloat16 ``param`` (which NumPy cannot compute with, or only
    rounding after every operation): parameter, gradient and state arrays are widened to
    float32 (exactly), one ``update`` runs in float32, and the parameter and the state
    are rounded back to bfloat16 (nearest even, as torch rounds) once. The state stays
    bfloat16 between steps, as torch keeps an optimizer's state in the parameter's dtype.
    """
    arrays = {key: value for key, value in state.items() if isinstance(value, np.ndarray)}
    wide: dict[str, Any] = {key: bfloat16_to_float32(value) for key, value in arrays.items()}
    param32 = bfloat16_to_float32(param)
    grad32 = bfloat16_to_float32(grad) if is_bfloat16(grad.dtype) else grad
    update(config, param32, grad32, wide, step)
    float32_to_bfloat16(param32, out=param)
    for key, value in wide.items():
        if key in arrays:
            float32_to_bfloat16(value, out=arrays[key])
        else:
            state[key] = float32_to_bfloat16(value)


class ShardOptimizer:
    """One optimizer over one flat shard: a config, its state and a step counter.

    The shard steps as a unit, so Adam's step counter is shared by all of its elements,
    just as every tensor of a model steps together in local training. The updates are
    elementwise, so a sharded step equals the unsharded step bit for bit. ``state`` holds
    the arrays of ``config.state_keys()``, created on the first step.
    """

    def __init__(self, config: OptimizerConfig, size: int, dtype: np.dtype[Any] | str) -> None:
        if not isinstance(config, (SGDConfig, AdamConfig)):
            raise TypeError(f"config must be SGDConfig or AdamConfig, "
                            f"got {type(config).__name__}")
        self.config = config
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self.steps = 0
        self.state: dict[str, np.ndarray] = {}
        self._scratch: np.ndarray | None = None

    def step(self, param: np.ndarray, grad: np.ndarray) -> None:
        """Update ``param`` in place from ``grad`` (both flat, ``size`` elements)."""
        if param.shape != (self.size,) or grad.shape != (self.size,):
            raise ValueError(f"shard optimizer holds {self.size} elements, got param "
                             f"{param.shape} and grad {grad.shape}")
        self.steps += 1
        scratch = None
        if isinstance(self.config, SGDConfig):  # spares a shard-sized temporary per product
            if self._scratch is None or self._scratch.shape != param.shape:
                self._scratch = np.empty_like(param)
            scratch = self._scratch
        update(self.config, param, grad, self.state, self.steps, scratch=scratch)


# -- front-end attributes -------------------------------------------------------------------

_V = TypeVar("_V")


class ConfigField(Generic[_V]):
    """Descriptor: ``front_end.<name>`` reads and writes field ``<name>`` of
    ``front_end.config``.

    A write replaces the config by a checked copy (``optimizer.lr = 0.01`` from a
    learning-rate schedule, say), so a front-end's attributes, its ``hyperparameters()``
    and its config can never disagree.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> ConfigField[_V]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _V: ...

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, "config"), self._name)

    def __set__(self, obj: Any, value: _V) -> None:
        obj.config = dataclasses.replace(obj.config, **{self._name: value})


class SGDAttributes:
    """``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``dampening`` of ``self.config``
    (an ``SGDConfig``)."""

    lr = ConfigField[float]()
    momentum = ConfigField[float]()
    nesterov = ConfigField[bool]()
    weight_decay = ConfigField[float]()
    dampening = ConfigField[float]()


class AdamAttributes:
    """``lr``, ``beta1``, ``beta2`` (``betas``), ``eps``, ``weight_decay``, ``amsgrad`` of
    ``self.config`` (an ``AdamConfig``)."""

    lr = ConfigField[float]()
    beta1 = ConfigField[float]()
    beta2 = ConfigField[float]()
    eps = ConfigField[float]()
    weight_decay = ConfigField[float]()
    amsgrad = ConfigField[bool]()

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)
