"""The shared SGD/Adam kernels against a plain reference and against ``torch.optim``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from netdist.optim_kernels import (adam_update, check_adam_hyperparameters, check_lr,
                                    check_sgd_hyperparameters, sgd_update)

STEPS = 5


def _data(seed: int = 0, shape: tuple[int, ...] = (4, 3)) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), [rng.standard_normal(shape) for _ in range(STEPS)]


def _sgd_reference(p0: np.ndarray, grads: list[np.ndarray], *, lr: float, momentum: float,
                   nesterov: bool, weight_decay: float, dampening: float) -> np.ndarray:
    """Element by element, the textbook torch SGD (Python floats, no vectorisation)."""
    p = p0.ravel().tolist()
    buf: list[float] | None = None
    for grad in grads:
        g = grad.ravel().tolist()
        d = [gi + weight_decay * pi for gi, pi in zip(g, p)]
        if momentum != 0:
            if buf is None:
                buf = list(d)
            else:
                buf = [momentum * b + (1 - dampening) * di for b, di in zip(buf, d)]
            d = [di + momentum * b for di, b in zip(d, buf)] if nesterov else list(buf)
        p = [pi - lr * di for pi, di in zip(p, d)]
    return np.array(p).reshape(p0.shape)


def _adam_reference(p0: np.ndarray, grads: list[np.ndarray], *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, amsgrad: bool) -> np.ndarray:
    p = p0.ravel().tolist()
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    vmax = [0.0] * len(p)
    for t, grad in enumerate(grads, start=1):
        g = [gi + weight_decay * pi for gi, pi in zip(grad.ravel().tolist(), p)]
        m = [beta1 * mi + (1 - beta1) * gi for mi, gi in zip(m, g)]
        v = [beta2 * vi + (1 - beta2) * gi * gi for vi, gi in zip(v, g)]
        vmax = [max(a, b) for a, b in zip(vmax, v)]
        use = vmax if amsgrad else v
        bc1 = 1 - beta1 ** t
        bc2 = 1 - beta2 ** t
        p = [pi - lr / bc1 * mi / (math.sqrt(vi) / math.sqrt(bc2) + eps)
             for pi, mi, vi in zip(p, m, use)]
    return np.array(p).reshape(p0.shape)


SGD_CASES = [
    dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0.0),
    dict(lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.01, dampening=0.0),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, dampening=0.0),
    dict(lr=0.02, momentum=0.5, nesterov=False, weight_decay=0.0, dampening=0.3),
]
ADAM_CASES = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False),
    dict(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, amsgrad=False),
    dict(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, amsgrad=True),
]


def _run_sgd(p0: np.ndarray, grads: list[np.ndarray], *, scratch: bool = False,
             preallocated: bool = False, **h: float) -> np.ndarray:
    p = p0.copy()
    buf: np.ndarray | None = np.full_like(p, 123.0) if preallocated else None
    tmp = np.empty_like(p) if scratch else None
    for t, g in enumerate(grads, start=1):
        first = (t == 1) if preallocated else None
        new = sgd_update(p, g, buf, first_step=first, scratch=tmp, **h)  # type: ignore[arg-type]
        if preallocated and h["momentum"] != 0:
            assert new is buf  # updated in place, never replaced
        buf = new
    if h["momentum"] == 0:
        assert buf is None or preallocated
    return p


def _run_adam(p0: np.ndarray, grads: list[np.ndarray], **h: float) -> np.ndarray:
    p = p0.copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    vmax = np.zeros_like(p) if h["amsgrad"] else None
    hyper = {k: val for k, val in h.items() if k != "amsgrad"}
    for t, g in enumerate(grads, start=1):
        adam_update(p, g, m, v, step=t, max_exp_avg_sq=vmax, **hyper)  # type: ignore[arg-type]
    return p


@pytest.mark.parametrize("hyper", SGD_CASES)
def test_sgd_matches_reference_and_variants_are_bitwise_equal(hyper: dict[str, float]) -> None:
    p0, grads = _data(1)
    out = _run_sgd(p0, grads, **hyper)
    np.testing.assert_allclose(out, _sgd_reference(p0, grads, **hyper), rtol=0, atol=1e-13)
    # the scratch and pre-allocated-buffer paths give exactly the same bits
    assert np.array_equal(_run_sgd(p0, grads, scratch=True, **hyper), out)
    assert np.array_equal(_run_sgd(p0, grads, preallocated=True, **hyper), out)


def test_sgd_without_momentum_returns_none_and_keeps_given_buffer() -> None:
    p = np.array([1.0, 2.0])
    assert sgd_update(p, np.array([1.0, -1.0]), None, lr=0.5, momentum=0.0, nesterov=False,
                      weight_decay=0.0) is None
    assert p.tolist() == [0.5, 2.5]


def test_sgd_first_step_buffer_is_a_copy_of_the_direction() -> None:
    p = np.array([1.0, 2.0], dtype=np.float32)
    g = np.array([0.5, 0.25], dtype=np.float32)
    buf = sgd_update(p, g, None, lr=1.0, momentum=0.9, nesterov=False, weight_decay=0.5)
    assert buf is not None and buf.dtype == np.float32
    assert buf.tolist() == [1.0, 1.25]   # grad + 0.5 * p
    assert p.tolist() == [0.0, 0.75]


@pytest.mark.parametrize("hyper", ADAM_CASES)
def test_adam_matches_reference(hyper: dict[str, float]) -> None:
    p0, grads = _data(2)
    out = _run_adam(p0, grads, **hyper)
    np.testing.assert_allclose(out, _adam_reference(p0, grads, **hyper), rtol=0, atol=1e-13)


def test_adam_first_step_moves_by_lr_times_sign() -> None:
    p = np.array([0.0, 0.0])
    m, v = np.zeros(2), np.zeros(2)
    adam_update(p, np.array([2.0, -3.0]), m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999,
                eps=0.0, weight_decay=0.0)
    np.testing.assert_allclose(p, [-0.1, 0.1], rtol=1e-12)
    np.testing.assert_allclose(m, [0.2, -0.3], rtol=1e-12)
    np.testing.assert_allclose(v, [0.004, 0.009], rtol=1e-12)


@pytest.mark.parametrize("hyper", SGD_CASES)
def test_sgd_matches_torch(hyper: dict[str, float]) -> None:
    torch = pytest.importorskip("torch")
    p0, grads = _data(3)
    tp = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([tp], lr=hyper["lr"], momentum=hyper["momentum"],
                          nesterov=bool(hyper["nesterov"]), weight_decay=hyper["weight_decay"],
                          dampening=hyper["dampening"], foreach=False)
    for g in grads:
        tp.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    np.testing.assert_allclose(_run_sgd(p0, grads, **hyper), tp.detach().numpy(),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize("hyper", ADAM_CASES)
def test_adam_matches_torch(hyper: dict[str, float]) -> None:
    torch = pytest.importorskip("torch")
    p0, grads = _data(4)
    tp = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([tp], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                           eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                           amsgrad=bool(hyper["amsgrad"]), foreach=False)
    for g in grads:
        tp.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    np.testing.assert_allclose(_run_adam(p0, grads, **hyper), tp.detach().numpy(),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check_lr(-0.1), "learning rate must be >= 0"),
    (lambda: check_lr(float("nan")), "learning rate must be >= 0"),
    (lambda: check_sgd_hyperparameters(momentum=-1.0, nesterov=False, weight_decay=0.0,
                                       dampening=0.0), "momentum must be >= 0"),
    (lambda: check_sgd_hyperparameters(momentum=0.9, nesterov=False, weight_decay=-1.0,
                                       dampening=0.0), "weight_decay must be >= 0"),
    (lambda: check_sgd_hyperparameters(momentum=0.9, nesterov=True, weight_decay=0.0,
                                       dampening=0.1), "Nesterov momentum requires"),
    (lambda: check_adam_hyperparameters(beta1=1.0, beta2=0.9, eps=1e-8, weight_decay=0.0),
     r"beta1 must be in \[0, 1\)"),
    (lambda: check_adam_hyperparameters(beta1=0.9, beta2=-0.1, eps=1e-8, weight_decay=0.0),
     r"beta2 must be in \[0, 1\)"),
    (lambda: check_adam_hyperparameters(beta1=0.9, beta2=0.9, eps=-1.0, weight_decay=0.0),
     "eps must be >= 0"),
])
def test_hyperparameter_checks_refuse_what_torch_refuses(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_hyperparameter_checks_accept_torch_defaults() -> None:
    check_lr(0.0)
    check_sgd_hyperparameters(momentum=0.9, nesterov=True, weight_decay=1e-4, dampening=0.0)
    check_adam_hyperparameters(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
