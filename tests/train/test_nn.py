"""Layers: shapes, seeded init, and backward passes against central finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.train.losses import mse_loss, softmax_cross_entropy
from netdist.train.nn import Linear, Module, Parameter, ReLU, Sequential, Tanh, mlp


def numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of scalar ``f()`` with respect to every element of ``x``."""
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        grad[i] = (fp - fm) / (2 * eps)
    return grad


def check_module_gradients(model: Module, x: np.ndarray, labels: np.ndarray) -> None:
    def loss_value() -> float:
        return softmax_cross_entropy(model(x), labels)[0]

    model.zero_grad()
    logits, ctx = model.forward(x)
    _, g = softmax_cross_entropy(logits, labels)
    gx = model.backward(ctx, g)
    for name, p in model.named_parameters():
        expected = numeric_grad(loss_value, p.data)
        np.testing.assert_allclose(p.grad, expected, rtol=1e-6, atol=1e-9, err_msg=name)
    np.testing.assert_allclose(gx, numeric_grad(loss_value, x), rtol=1e-6, atol=1e-9)


def test_mlp_relu_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    model = Sequential(Linear(5, 7, rng=rng), ReLU(), Linear(7, 4, rng=rng))
    x = rng.normal(size=(6, 5))
    labels = np.array([0, 1, 2, 3, 1, 0])
    check_module_gradients(model, x, labels)


def test_mlp_tanh_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    model = mlp([3, 6, 5, 3], rng=rng, activation=Tanh)
    x = rng.normal(size=(4, 3))
    check_module_gradients(model, x, np.array([2, 0, 1, 2]))


def test_mse_gradient_through_linear():
    rng = np.random.default_rng(2)
    layer = Linear(3, 2, rng=rng)
    x = rng.normal(size=(5, 3))
    target = rng.normal(size=(5, 2))
    layer.zero_grad()
    y, ctx = layer.forward(x)
    _, g = mse_loss(y, target)
    layer.backward(ctx, g)
    expected = numeric_grad(lambda: mse_loss(layer(x), target)[0], layer.weight.data)
    np.testing.assert_allclose(layer.weight.grad, expected, rtol=1e-6, atol=1e-10)


def test_linear_accepts_leading_dimensions():
    rng = np.random.default_rng(3)
    layer = Linear(4, 3, rng=rng)
    x = rng.normal(size=(2, 5, 4))
    y, ctx = layer.forward(x)
    assert y.shape == (2, 5, 3)
    np.testing.assert_allclose(y, x @ layer.weight.data.T + layer.bias.data)
    gx = layer.backward(ctx, np.ones_like(y))
    assert gx.shape == x.shape
    np.testing.assert_allclose(layer.bias.grad, np.full(3, 10.0))
    np.testing.assert_allclose(layer.weight.grad, np.tile(x.reshape(-1, 4).sum(0), (3, 1)))


def test_gradients_accumulate_until_zero_grad():
    rng = np.random.default_rng(4)
    layer = Linear(2, 2, rng=rng)
    x = rng.normal(size=(3, 2))
    grads = []
    for _ in range(2):
        y, ctx = layer.forward(x)
        layer.backward(ctx, np.ones_like(y))
        grads.append(layer.weight.grad.copy())
    np.testing.assert_array_equal(grads[1], 2 * grads[0])
    layer.zero_grad()
    assert not layer.weight.grad.any() and not layer.bias.grad.any()


def test_seeded_init_is_reproducible_and_torch_bounded():
    a = mlp([64, 128, 10], rng=np.random.default_rng(7))
    b = mlp([64, 128, 10], rng=np.random.default_rng(7))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.data, pb.data)
    w = a.layers[0].weight.data
    assert w.shape == (128, 64) and w.dtype == np.float64
    assert np.abs(w).max() <= 1 / 8 and np.abs(w).max() > 0.12


def test_named_parameters_are_qualified_and_set_on_the_parameter():
    rng = np.random.default_rng(0)
    inner = Sequential(Linear(2, 3, rng=rng), ReLU())
    model = Sequential(Linear(4, 2, rng=rng), inner)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    assert [p.name for p in model.parameters()] == names


def test_float32_model_stays_float32():
    rng = np.random.default_rng(0)
    model = mlp([4, 8, 3], rng=rng, dtype=np.float32)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    logits, ctx = model.forward(x)
    _, g = softmax_cross_entropy(logits, np.array([0, 2]))
    model.backward(ctx, g)
    assert logits.dtype == np.float32 and g.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.parameters())


def test_layers_read_param_data_at_call_time():
    """FSDP swaps ``param.data`` between forward and backward; nothing may be cached."""
    rng = np.random.default_rng(5)
    layer = Linear(3, 2, rng=rng)
    x = rng.normal(size=(4, 3))
    _, ctx = layer.forward(x)
    layer.weight.data = np.ones((2, 3))
    gx = layer.backward(ctx, np.ones((4, 2)))
    np.testing.assert_array_equal(gx, np.full((4, 3), 2.0))


def test_module_state_dict_round_trip():
    rng = np.random.default_rng(0)
    a = mlp([3, 4, 2], rng=rng)
    b = mlp([3, 4, 2], rng=np.random.default_rng(1))
    b.load_state_dict(a.state_dict())
    for pa, pb in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(pa.data, pb.data)
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"0.weight": np.zeros((4, 3))})


def test_validation():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        Linear(0, 2, rng=rng)
    with pytest.raises(TypeError):
        Linear(2, 2, rng=np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="last dimension 2"):
        Linear(2, 2, rng=rng).forward(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="grad shape"):
        Parameter("w", np.zeros(3), np.zeros(2))
    with pytest.raises(TypeError):
        Sequential(Linear(2, 2, rng=rng), object())  # type: ignore[arg-type]
    shared = Linear(2, 2, rng=rng)
    with pytest.raises(ValueError, match="twice"):
        Sequential(shared, shared)


# ---------------------------------------------------------------- gradient-ready hooks

class Scale(Module):
    """A user layer that knows nothing of hooks: ``y = x * s`` with one parameter."""

    def __init__(self, features: int) -> None:
        self.s = Parameter("s", np.full(features, 2.0))

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [("s", self.s)]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x * self.s.data, x

    def backward(self, ctx: np.ndarray, grad_out: np.ndarray) -> np.ndarray:
        self.s.grad += (grad_out * ctx).reshape(-1, ctx.shape[-1]).sum(0)
        return grad_out * self.s.data


def hooked_model() -> Sequential:
    rng = np.random.default_rng(11)
    return Sequential(Linear(6, 5, rng=rng), Tanh(),
                      Sequential(Linear(5, 4, rng=rng), ReLU(), Scale(4)),
                      Linear(4, 3, rng=rng))


def test_grad_ready_hook_reports_each_parameter_once_final_and_last_layer_first():
    rng = np.random.default_rng(12)
    x, labels = rng.normal(size=(8, 6)), rng.integers(0, 3, 8)
    plain, hooked = hooked_model(), hooked_model()
    logits, ctx = plain.forward(x)
    _, g = softmax_cross_entropy(logits, labels)
    gx_plain = plain.backward(ctx, g)

    reports: list[tuple[str, bytes, bool]] = []
    first = hooked.parameters()[0]

    def on_ready(p: Parameter) -> None:
        # the gradient as reported, and whether the first layer had been reached yet
        reports.append((p.name, p.grad.tobytes(), bool(first.grad.any())))

    logits, ctx = hooked.forward(x)
    _, g = softmax_cross_entropy(logits, labels)
    gx = hooked.backward(ctx, g, on_grad_ready=on_ready)

    np.testing.assert_array_equal(gx, gx_plain)  # the hook changes nothing
    names = [name for name, _ in hooked.named_parameters()]
    assert [r[0] for r in reports] == list(reversed(names))  # once each, last layer first
    assert names == ["0.weight", "0.bias", "2.0.weight", "2.0.bias", "2.2.s", "3.weight",
                     "3.bias"]
    final = {p.name: p.grad.tobytes() for p in plain.parameters()}
    for name, grad, first_reached in reports:
        assert grad == final[name], f"{name} was reported before it was final"
        assert first_reached == name.startswith("0."), name  # reported before layer 0 ran


def test_grad_ready_hook_on_a_single_module_and_errors_propagate():
    layer = Scale(3)
    y, ctx = layer.forward(np.ones((2, 3)))
    seen: list[str] = []
    layer.backward_reporting(ctx, np.ones_like(y), lambda p: seen.append(p.name))
    assert seen == ["s"]
    np.testing.assert_array_equal(layer.s.grad, [2.0, 2.0, 2.0])

    model = hooked_model()
    logits, ctx = model.forward(np.ones((1, 6)))

    def refuse(p: Parameter) -> None:
        raise RuntimeError(f"hook refused {p.name}")

    with pytest.raises(RuntimeError, match="hook refused 3.bias"):
        model.backward(ctx, np.ones_like(logits), on_grad_ready=refuse)
