"""A tiny NumPy MLP with hand-written gradients, shared by the parameter-server tests.

Kept local so the parameter-server tests depend on nothing above ``netdist.ps``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def init_mlp(rng: np.random.Generator, sizes: tuple[int, ...] = (6, 16, 3),
             dtype: type = np.float64) -> list[np.ndarray]:
    """[W1, b1, W2, b2, ...] with W of shape (out, in)."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_out, fan_in)) / np.sqrt(fan_in)).astype(dtype))
        params.append((0.1 * rng.standard_normal(fan_out)).astype(dtype))
    return params


def mse_grads(params: list[np.ndarray], x: np.ndarray,
              y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean squared error over the batch and its gradients (same order as ``params``)."""
    layers = len(params) // 2
    acts = [x]
    h = x
    for i in range(layers):
        h = h @ params[2 * i].T + params[2 * i + 1]
        if i < layers - 1:
            h = np.tanh(h)
        acts.append(h)
    diff = acts[-1] - y
    loss = float(np.mean(np.sum(diff * diff, axis=1)))
    delta = 2.0 * diff / x.shape[0]
    grads: list[np.ndarray] = [np.empty(0)] * len(params)
    for i in reversed(range(layers)):
        grads[2 * i] = delta.T @ acts[i]
        grads[2 * i + 1] = delta.sum(axis=0)
        if i > 0:
            delta = (delta @ params[2 * i]) * (1.0 - acts[i] ** 2)
    return loss, grads


def softmax_ce_grads(params: list[np.ndarray], x: np.ndarray,
                     labels: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Softmax cross-entropy (mean over the batch) for a linear/MLP classifier."""
    layers = len(params) // 2
    acts = [x]
    h = x
    for i in range(layers):
        h = h @ params[2 * i].T + params[2 * i + 1]
        if i < layers - 1:
            h = np.tanh(h)
        acts.append(h)
    logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = float(-np.mean(np.log(probs[np.arange(n), labels] + 1e-300)))
    delta = probs
    delta[np.arange(n), labels] -= 1.0
    delta /= n
    grads: list[np.ndarray] = [np.empty(0)] * len(params)
    for i in reversed(range(layers)):
        grads[2 * i] = delta.T @ acts[i]
        grads[2 * i + 1] = delta.sum(axis=0)
        if i > 0:
            delta = (delta @ params[2 * i]) * (1.0 - acts[i] ** 2)
    return loss, grads


def regression_data(rng: np.random.Generator, n: int, d_in: int = 6,
                    d_out: int = 3) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, d_in))
    w = rng.standard_normal((d_in, d_out))
    y = np.tanh(x @ w) + 0.01 * rng.standard_normal((n, d_out))
    return x, y


DYADIC_SHAPES: tuple[tuple[int, ...], ...] = ((40,), (20, 15))
"""Shapes of the order-free model: with ``bigarray_bound=200`` the second is sliced
across two servers."""


def dyadic_params() -> list[np.ndarray]:
    """Zero initial parameters of the order-free model."""
    return [np.zeros(shape) for shape in DYADIC_SHAPES]


def dyadic_grads(worker: int, step: int) -> list[np.ndarray]:
    """Gradients that do not depend on the parameters: multiples of 3/8, so divided by 3
    workers (or 2, or 1) and scaled by a power-of-two learning rate every sum of them is
    exact in float64, in any order. Asynchronous training over them ends at one exact
    value, ``init - lr / W * (sum of every applied gradient)``, whatever the order the
    pushes applied in: a lost update or one applied twice shows."""
    grads = []
    for shape in DYADIC_SHAPES:
        n = int(np.prod(shape))
        ints = (np.arange(n) + 7 * worker + 3 * step) % 5 + 1
        grads.append((3.0 * ints / 8.0).reshape(shape))
    return grads


def dyadic_result(applied: Iterable[tuple[int, int]], workers: int,
                  lr: float) -> list[np.ndarray]:
    """The order-free model after the pushes ``(worker, step)`` in ``applied``, as servers
    running SGD with ``lr`` and averaging over ``workers`` apply them (any order gives
    these exact values)."""
    params = dyadic_params()
    for worker, step in applied:
        for p, g in zip(params, dyadic_grads(worker, step)):
            p -= lr * (g / workers)
    return params
