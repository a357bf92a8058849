"""``netdist.optim``: the one optimizer vocabulary the three front-ends share."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from netdist.optim import (
    AdamConfig,
    ConfigField,
    SGDConfig,
    ShardOptimizer,
    config_from_hyperparameters,
    optimizer_config_from_dict,
    update,
    update_widened,
)
from netdist.parallel.sharded_optim import ShardedAdam, ShardedSGD
from netdist.train.nn import Parameter
from netdist.train.optimizers import SGD, Adam
from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.types import BFLOAT16

CONFIGS = [SGDConfig(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
           SGDConfig(lr=0.02, momentum=0.5, dampening=0.3),
           AdamConfig(lr=0.01, beta1=0.8, weight_decay=0.05, amsgrad=True)]


def _trajectory_data(seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(17), [rng.standard_normal(17) for _ in range(5)]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_three_front_ends_follow_one_trajectory_bitwise(config: Any) -> None:
    init, grads = _trajectory_data()
    param = Parameter("p", init.copy())
    hyper = config.hyperparameters()
    if isinstance(config, SGDConfig):
        local: SGD | Adam = SGD([param], **hyper)
        sharded: ShardedSGD | ShardedAdam = ShardedSGD(**hyper)
    else:
        betas = (hyper.pop("beta1"), hyper.pop("beta2"))
        local = Adam([param], betas=betas, **hyper)
        sharded = ShardedAdam(betas=betas, **hyper)
    assert local.config == sharded.config == config
    flat = init.copy()
    fsdp_state = {key: np.zeros(17) for key in sharded.state_keys()}
    server_param = init.copy()
    server = ShardOptimizer(config, 17, np.float64)
    for step, grad in enumerate(grads, start=1):
        param.grad[...] = grad
        local.step()
        sharded.update(flat, grad.copy(), fsdp_state, step)
        server.step(server_param, grad.copy())
    assert param.data.tobytes() == flat.tobytes() == server_param.tobytes()
    assert sorted(server.state) == sorted(config.state_keys())


def test_configs_hold_plain_floats_and_bools_and_round_trip() -> None:
    sgd = SGDConfig(lr=1, momentum=0, nesterov=0)  # type: ignore[arg-type]
    assert (type(sgd.lr), type(sgd.momentum), type(sgd.nesterov)) == (float, float, bool)
    assert sgd == SGDConfig(lr=1.0)
    assert sgd.to_dict() == {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False,
                             "weight_decay": 0.0, "dampening": 0.0}
    assert list(sgd.hyperparameters()) == ["lr", "momentum", "dampening", "weight_decay",
                                           "nesterov"]
    adam = AdamConfig(lr=0.01, amsgrad=True)
    assert adam.betas == (0.9, 0.999)
    assert list(adam.hyperparameters()) == ["lr", "beta1", "beta2", "eps", "weight_decay",
                                            "amsgrad"]
    for config in (sgd, adam):
        assert optimizer_config_from_dict(config.to_dict()) == config
        assert config_from_hyperparameters(config.hyperparameters()) == config
    assert config_from_hyperparameters({"lr": 0.1}) is None
    with pytest.raises(ValueError, match="malformed optimizer config"):
        optimizer_config_from_dict({"name": "sgd", "lr": "fast"})


def test_state_keys_per_rule() -> None:
    assert SGDConfig(lr=0.1).state_keys() == ()
    assert SGDConfig(lr=0.1, momentum=0.9).state_keys() == ("momentum_buffer",)
    assert AdamConfig().state_keys() == ("exp_avg", "exp_avg_sq")
    assert AdamConfig(amsgrad=True).state_keys() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def test_with_hyperparameters_checks_and_names_the_owner() -> None:
    config = SGDConfig(lr=0.1, momentum=0.9)
    assert config.with_hyperparameters({"lr": 1}, "SGD") == SGDConfig(lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match="unknown hyper-parameter 'beta1' for SGD"):
        config.with_hyperparameters({"beta1": 0.9}, "SGD")
    with pytest.raises(ValueError, match="Nesterov"):
        SGDConfig(lr=0.1).with_hyperparameters({"nesterov": True}, "SGD")


def test_sgd_first_step_by_presence_or_by_step_number() -> None:
    config = SGDConfig(lr=1.0, momentum=0.5)
    # no count kept (step None): the buffer's presence alone marks later steps
    p = np.array([1.0, 1.0])
    state: dict[str, Any] = {}
    update(config, p, np.array([1.0, 2.0]), state, None)
    assert state["momentum_buffer"].tolist() == [1.0, 2.0] and p.tolist() == [0.0, -1.0]
    update(config, p, np.array([1.0, 2.0]), state, None)
    assert state["momentum_buffer"].tolist() == [1.5, 3.0] and p.tolist() == [-1.5, -4.0]
    # a buffer allocated in advance holds no history on step 1: overwritten, not decayed
    q = np.array([1.0, 1.0])
    buffer = np.array([7.0, 7.0])
    preallocated = {"momentum_buffer": buffer}
    update(config, q, np.array([1.0, 2.0]), preallocated, 1)
    assert preallocated["momentum_buffer"] is buffer and buffer.tolist() == [1.0, 2.0]
    update(config, q, np.array([1.0, 2.0]), preallocated, 2)
    assert buffer.tolist() == [1.5, 3.0] and q.tolist() == [-1.5, -4.0]


def test_adam_creates_zero_state_and_needs_the_step_number() -> None:
    state: dict[str, Any] = {"step": 41}
    p = np.array([0.0, 0.0])
    update(AdamConfig(lr=0.1, eps=0.0, amsgrad=True), p, np.array([2.0, -3.0]), state, 1)
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert state["step"] == 41  # other entries are the caller's
    np.testing.assert_allclose(p, [-0.1, 0.1], rtol=1e-12)
    with pytest.raises(ValueError, match="step number"):
        update(AdamConfig(), p, p.copy(), state, None)


def test_update_widened_rounds_bfloat16_once_per_step() -> None:
    config = SGDConfig(lr=0.1, momentum=0.9)
    values = np.array([1.0, -2.0, 0.3], np.float32)
    grad32 = np.array([0.5, 0.25, -1.0], np.float32)
    param = float32_to_bfloat16(values)
    grad = float32_to_bfloat16(grad32)
    state: dict[str, Any] = {}
    update_widened(config, param, grad, state, 1)
    assert state["momentum_buffer"].dtype == BFLOAT16 and param.dtype == BFLOAT16
    # the reference: the float32 update of the widened values, rounded to bfloat16 once
    expect32 = bfloat16_to_float32(float32_to_bfloat16(values))
    reference: dict[str, Any] = {}
    update(config, expect32, bfloat16_to_float32(grad), reference, 1)
    assert param.view(np.uint16).tolist() == \
        float32_to_bfloat16(expect32).view(np.uint16).tolist()
    assert state["momentum_buffer"].view(np.uint16).tolist() == \
        float32_to_bfloat16(reference["momentum_buffer"]).view(np.uint16).tolist()
    kept = state["momentum_buffer"]
    update_widened(config, param, grad, state, 2)
    assert state["momentum_buffer"] is kept  # rounded back into the same array


def test_front_end_attributes_read_and_write_the_config() -> None:
    opt = SGD([Parameter("w", np.zeros(2))], lr=0.1, momentum=0.9)
    assert isinstance(SGD.lr, ConfigField)
    opt.lr = 0.5
    assert opt.config == SGDConfig(lr=0.5, momentum=0.9)
    assert opt.hyperparameters()["lr"] == 0.5
    with pytest.raises(ValueError, match="momentum"):
        opt.momentum = -1.0
    assert opt.momentum == 0.9  # a refused write leaves the config as it was
    adam = ShardedAdam(0.01, betas=(0.8, 0.9))
    adam.beta2 = 0.95
    assert adam.betas == (0.8, 0.95) and adam.config.beta2 == 0.95
    assert repr(adam) == ("ShardedAdam(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-08, "
                          "weight_decay=0.0, amsgrad=False)")
