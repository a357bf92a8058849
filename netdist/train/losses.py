"""Loss functions returning ``(loss, grad)`` with hand-written gradients.

Both reduce by the mean over the batch, as torch's defaults do. That choice is what makes
data parallelism exact: the mean over a global batch of ``n * b`` samples equals the
average of ``n`` per-rank means over ``b`` samples each, so averaging gradients across
ranks reproduces single-process training with the larger batch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["softmax_cross_entropy", "mse_loss", "log_softmax"]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable ``log(softmax(logits))`` along the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of ``softmax(logits)`` against integer class ``labels``.

    ``logits`` is ``(batch, classes)``, ``labels`` is ``(batch,)`` integers in
    ``[0, classes)``. Returns the loss as a Python float and ``d(loss)/d(logits)``,
    ``(softmax(logits) - onehot(labels)) / batch``, in the dtype of ``logits``.
    """
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {logits.shape}")
    batch, classes = logits.shape
    if labels.shape != (batch,):
        raise ValueError(f"labels must have shape ({batch},), got {labels.shape}")
    if batch == 0:
        raise ValueError("softmax_cross_entropy needs a non-empty batch")
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got {labels.dtype}")
    if labels.min() < 0 or labels.max() >= classes:
        raise ValueError(f"labels must lie in [0, {classes}), got range "
                         f"[{labels.min()}, {labels.max()}]")
    logp = log_softmax(logits)
    rows = np.arange(batch)
    loss = -float(logp[rows, labels].sum()) / batch
    grad = np.exp(logp)
    grad[rows, labels] -= 1
    grad /= batch
    return loss, grad


def mse_loss(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean over all elements of ``(pred - target) ** 2`` and its gradient w.r.t. ``pred``."""
    pred = np.asarray(pred)
    target = np.asarray(target)
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {pred.shape} differs from target shape {target.shape}")
    if pred.size == 0:
        raise ValueError("mse_loss needs a non-empty input")
    diff = pred - target
    loss = float(np.mean(diff * diff))
    grad = diff * (2.0 / pred.size)
    return loss, grad.astype(pred.dtype, copy=False)
