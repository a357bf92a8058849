"""Sharded optimizers apply netdist.train's SGD/Adam update rules element by element."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from netdist.parallel.sharded_optim import (
    ShardedAdam,
    ShardedSGD,
    sharded_optimizer_from,
)
from netdist.train.nn import Parameter
from netdist.train.optimizers import SGD, Adam

STEPS = 6


def run_pair(reference_factory, sharded: Any, slices: list[slice]) -> tuple[np.ndarray, np.ndarray]:
    """Train one parameter with the reference optimizer, and the same values split into
    ``slices`` with the sharded one; return both final parameters."""
    rng = np.random.default_rng(3)
    init = rng.standard_normal(23)
    grads = [rng.standard_normal(23) for _ in range(STEPS)]
    param = Parameter("p", init.copy())
    reference = reference_factory([param])
    flat = init.copy()
    states = [{key: np.zeros(s.stop - s.start) for key in sharded.state_keys()} for s in slices]
    for step, grad in enumerate(grads, start=1):
        param.grad[...] = grad
        reference.step()
        for s, state in zip(slices, states):
            sharded.update(flat[s], grad[s].copy(), state, step)
    return param.data, flat


SLICES = [slice(0, 8), slice(8, 16), slice(16, 23)]


@pytest.mark.parametrize("kwargs", [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.5, "dampening": 0.3, "weight_decay": 0.1},
])
def test_sharded_sgd_is_bitwise_torch_sgd(kwargs):
    expected, got = run_pair(lambda p: SGD(p, lr=0.05, **kwargs), ShardedSGD(0.05, **kwargs),
                             SLICES)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kwargs", [
    {},
    {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05},
    {"amsgrad": True},
])
def test_sharded_adam_is_bitwise_torch_adam(kwargs):
    expected, got = run_pair(lambda p: Adam(p, lr=0.01, **kwargs), ShardedAdam(0.01, **kwargs),
                             SLICES)
    np.testing.assert_array_equal(got, expected)


def test_state_keys():
    assert ShardedSGD(0.1).state_keys() == ()
    assert ShardedSGD(0.1, momentum=0.9).state_keys() == ("momentum_buffer",)
    assert ShardedAdam().state_keys() == ("exp_avg", "exp_avg_sq")
    assert ShardedAdam(amsgrad=True).state_keys() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def test_from_train_optimizer_copies_hyperparameters():
    p = [Parameter("w", np.zeros(3))]
    sgd = sharded_optimizer_from(SGD(p, lr=0.2, momentum=0.9, nesterov=True, weight_decay=0.1))
    assert isinstance(sgd, ShardedSGD)
    assert sgd.hyperparameters() == {"lr": 0.2, "momentum": 0.9, "dampening": 0.0,
                                     "weight_decay": 0.1, "nesterov": True}
    adam = sharded_optimizer_from(Adam(p, lr=0.003, betas=(0.8, 0.9), eps=1e-7, amsgrad=True))
    assert isinstance(adam, ShardedAdam)
    assert adam.hyperparameters() == {"lr": 0.003, "beta1": 0.8, "beta2": 0.9, "eps": 1e-7,
                                      "weight_decay": 0.0, "amsgrad": True}
    with pytest.raises(TypeError, match="hyperparameters"):
        sharded_optimizer_from(object())


def test_validation_and_hyperparameter_loading():
    with pytest.raises(ValueError, match="learning rate"):
        ShardedSGD(-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        ShardedSGD(0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta1"):
        ShardedAdam(betas=(1.0, 0.9))
    adam = ShardedAdam(0.1)
    adam.load_hyperparameters({"lr": 0.5, "amsgrad": True})
    assert (adam.lr, adam.amsgrad) == (0.5, True)
    with pytest.raises(ValueError, match="unknown hyper-parameter"):
        adam.load_hyperparameters({"momentum": 0.9})
