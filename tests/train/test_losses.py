"""Losses: exact values on hand-computed cases, gradients against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from netdist.train.losses import log_softmax, mse_loss, softmax_cross_entropy

from tests.train.test_nn import numeric_grad


def test_cross_entropy_uniform_logits_is_log_classes():
    loss, grad = softmax_cross_entropy(np.zeros((2, 4)), np.array([1, 3]))
    assert loss == pytest.approx(math.log(4), abs=1e-15)
    np.testing.assert_allclose(grad, np.array([[0.125, -0.375, 0.125, 0.125],
                                               [0.125, 0.125, 0.125, -0.375]]))


def test_cross_entropy_gradient_and_stability():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 3)) * 3
    labels = np.array([0, 2, 1, 1, 0])
    _, grad = softmax_cross_entropy(logits, labels)
    expected = numeric_grad(lambda: softmax_cross_entropy(logits, labels)[0], logits)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-10)
    big = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    loss, g = softmax_cross_entropy(big, np.array([0, 0]))
    assert loss == pytest.approx(500.0)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(np.exp(log_softmax(logits)).sum(axis=1), 1.0)


def test_mean_over_batch_splits_exactly():
    """Mean of per-shard means of equal shards == mean of the whole batch (DP exactness)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 5))
    labels = rng.integers(0, 5, size=8)
    whole, gw = softmax_cross_entropy(logits, labels)
    parts = [softmax_cross_entropy(logits[i::2], labels[i::2]) for i in range(2)]
    assert (parts[0][0] + parts[1][0]) / 2 == pytest.approx(whole, abs=1e-14)
    np.testing.assert_allclose(parts[0][1] / 2, gw[0::2], atol=1e-16)


def test_mse_loss_values_and_gradient():
    pred = np.array([[1.0, 2.0], [3.0, 5.0]])
    target = np.array([[1.0, 0.0], [3.0, 4.0]])
    loss, grad = mse_loss(pred, target)
    assert loss == 5.0 / 4
    np.testing.assert_array_equal(grad, np.array([[0.0, 1.0], [0.0, 0.5]]))


def test_loss_validation():
    with pytest.raises(ValueError, match="labels must lie"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(TypeError):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError):
        softmax_cross_entropy(np.zeros(3), np.array([0]))
    with pytest.raises(ValueError, match="differs"):
        mse_loss(np.zeros(2), np.zeros(3))
