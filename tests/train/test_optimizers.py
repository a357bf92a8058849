"""Optimizers: torch's update rules, hand-computed steps, state dict round trips."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.train.nn import Parameter
from netdist.train.optimizers import SGD, Adam


def make_params(seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [Parameter("w", rng.normal(size=(3, 2))), Parameter("b", rng.normal(size=3))]


def run(opt_factory, grads_seq, seed: int = 0) -> list[Parameter]:
    params = make_params(seed)
    opt = opt_factory(params)
    for grads in grads_seq:
        for p, g in zip(params, grads):
            p.grad[...] = g
        opt.step()
    return params


def grad_sequence(steps: int = 5, seed: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=(3, 2)), rng.normal(size=3)] for _ in range(steps)]


def test_sgd_plain_momentum_and_nesterov_by_hand():
    p = Parameter("x", np.array([1.0]))
    opt = SGD([p], lr=0.5, momentum=0.9, weight_decay=0.1)
    p.grad[...] = 2.0
    opt.step()  # d = 2 + 0.1 = 2.1 ; buf = 2.1 ; x = 1 - 1.05
    assert p.data[0] == pytest.approx(-0.05, abs=1e-15)
    opt.step()  # d = 2 - 0.005 = 1.995 ; buf = 1.89 + 1.995 = 3.885 ; x = -0.05 - 1.9425
    assert p.data[0] == pytest.approx(-1.9925, abs=1e-14)

    q = Parameter("x", np.array([1.0]))
    nest = SGD([q], lr=0.5, momentum=0.9, nesterov=True)
    q.grad[...] = 2.0
    nest.step()  # buf = 2 ; d = 2 + 1.8 = 3.8 ; x = 1 - 1.9
    assert q.data[0] == pytest.approx(-0.9, abs=1e-15)


def test_adam_first_step_is_lr_times_sign():
    p = Parameter("x", np.array([1.0, 1.0, 1.0]))
    opt = Adam([p], lr=0.1, eps=0.0)
    p.grad[...] = [3.0, -0.5, 1e-3]
    opt.step()
    np.testing.assert_allclose(p.data, [0.9, 1.1, 0.9], rtol=0, atol=1e-14)
    assert opt.state["x"]["step"] == 1


@pytest.mark.parametrize("kind", ["sgd", "sgd_momentum", "sgd_nesterov", "sgd_damp",
                                  "adam", "adam_wd", "adam_amsgrad"])
def test_matches_torch(kind):
    torch = pytest.importorskip("torch")
    factories = {
        "sgd": (lambda ps: SGD(ps, lr=0.1, weight_decay=0.01),
                lambda ts: torch.optim.SGD(ts, lr=0.1, weight_decay=0.01)),
        "sgd_momentum": (lambda ps: SGD(ps, lr=0.1, momentum=0.9),
                         lambda ts: torch.optim.SGD(ts, lr=0.1, momentum=0.9)),
        "sgd_nesterov": (lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                         lambda ts: torch.optim.SGD(ts, lr=0.1, momentum=0.9, nesterov=True,
                                                    weight_decay=1e-3)),
        "sgd_damp": (lambda ps: SGD(ps, lr=0.1, momentum=0.8, dampening=0.3),
                     lambda ts: torch.optim.SGD(ts, lr=0.1, momentum=0.8, dampening=0.3)),
        "adam": (lambda ps: Adam(ps, lr=0.01),
                 lambda ts: torch.optim.Adam(ts, lr=0.01, foreach=False)),
        "adam_wd": (lambda ps: Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                    lambda ts: torch.optim.Adam(ts, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                                weight_decay=0.1, foreach=False)),
        "adam_amsgrad": (lambda ps: Adam(ps, lr=0.01, amsgrad=True),
                         lambda ts: torch.optim.Adam(ts, lr=0.01, amsgrad=True, foreach=False)),
    }
    ours, theirs = factories[kind]
    seq = grad_sequence(6)
    params = run(ours, seq)
    tensors = [torch.tensor(p.data, dtype=torch.float64, requires_grad=True)
               for p in make_params()]
    topt = theirs(tensors)
    for grads in seq:
        for t, g in zip(tensors, grads):
            t.grad = torch.tensor(g, dtype=torch.float64)
        topt.step()
    for p, t in zip(params, tensors):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("factory", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: Adam(ps, lr=0.01, weight_decay=0.01, amsgrad=True),
])
def test_state_dict_resume_is_bitwise(factory):
    seq = grad_sequence(6)
    straight = run(factory, seq)

    params = make_params()
    opt = factory(params)
    for grads in seq[:3]:
        for p, g in zip(params, grads):
            p.grad[...] = g
        opt.step()
    saved_state = opt.state_dict()
    saved_params = [p.data.copy() for p in params]
    for leaf in saved_state["state"].values():
        assert all(isinstance(v, (np.ndarray, int)) for v in leaf.values())
    assert all(isinstance(v, (int, float, bool)) for v in saved_state["hyperparams"].values())

    resumed = make_params(seed=9)
    for p, data in zip(resumed, saved_params):
        p.data[...] = data
    opt2 = factory(resumed)
    opt2.load_state_dict(saved_state)
    for grads in seq[3:]:
        for p, g in zip(resumed, grads):
            p.grad[...] = g
        opt2.step()
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a.data, b.data)


def test_state_dict_is_a_copy_and_hyperparams_restore():
    params = make_params()
    opt = SGD(params, lr=0.1, momentum=0.5)
    params[0].grad[...] = 1.0
    opt.step()
    sd = opt.state_dict()
    sd["state"]["w"]["momentum_buffer"][...] = 42.0
    assert opt.state["w"]["momentum_buffer"][0, 0] == 1.0
    other = SGD(make_params(), lr=0.9)
    other.load_state_dict(sd)
    assert other.lr == 0.1 and other.momentum == 0.5


def test_optimizer_validation():
    with pytest.raises(ValueError, match="unique"):
        SGD([Parameter("w", np.zeros(1)), Parameter("w", np.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(make_params(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        Adam(make_params(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="empty"):
        SGD([], lr=0.1)
    opt = SGD(make_params(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="unknown parameter"):
        opt.load_state_dict({"state": {"nope": {}}})
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict({"state": {"w": {"momentum_buffer": np.zeros(5)}}})


def test_zero_grad_keeps_arrays():
    params = make_params()
    opt = Adam(params)
    grad_obj = params[0].grad
    grad_obj[...] = 3.0
    opt.zero_grad()
    assert params[0].grad is grad_obj and not grad_obj.any()
