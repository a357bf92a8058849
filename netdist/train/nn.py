"""A small NumPy neural-network kit with hand-written backward passes.

The layers are functional in style: ``forward(x)`` returns ``(y, ctx)`` and
``backward(ctx, grad_out)`` returns the gradient with respect to the input and *adds*
the parameter gradients into ``param.grad``. Nothing about a particular call is kept on
the module, so a pipeline stage can hold several micro-batches in flight (one ``ctx`` per
micro-batch), and gradients of several micro-batches accumulate like ``loss.backward()``
calls in torch.

Layers read ``param.data`` at the moment ``forward``/``backward`` runs and never keep a
reference to a weight inside ``ctx``, so FSDP can point ``param.data`` at freshly gathered
storage before each call and release it afterwards.

Backward can report each parameter's gradient as soon as it is final, for overlapping
the gradient all-reduce with the rest of backward (DDP's autograd hooks):
``model.backward(ctx, grad, on_grad_ready=hook)`` on a ``Sequential`` calls ``hook(param)``
once per parameter, right after the layer that owns it has finished its backward, last
layers first. Any ``Module`` takes part through ``backward_reporting`` (by default:
``backward``, then report the module's own parameters); without a hook nothing changes.

Initialisation is seeded through an explicit ``numpy.random.Generator``: the same seed
gives the same model on every rank and every run, with no global random state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Parameter",
    "GradReadyHook",
    "Module",
    "Linear",
    "Embedding",
    "ReLU",
    "Tanh",
    "Sequential",
    "mlp",
]


@dataclass(slots=True, eq=False)
class Parameter:
    """A named trainable array and its gradient accumulator.

    ``grad`` has the shape and dtype of ``data`` and accumulates across ``backward``
    calls until ``zero_grad``. Both are plain arrays that other layers (FSDP, the
    optimizers, checkpointing) may replace or update in place. ``name`` is the fully
    qualified name once the parameter sits inside a ``Sequential`` (``"0.weight"``).
    """

    name: str
    data: np.ndarray
    grad: np.ndarray = None  # type: ignore[assignment]  # zeros_like(data) when omitted

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray):
            raise TypeError(f"parameter {self.name!r}: data must be an ndarray, "
                            f"got {type(self.data).__name__}")
        if self.grad is None:
            self.grad = np.zeros_like(self.data)
        elif self.grad.shape != self.data.shape:
            raise ValueError(f"parameter {self.name!r}: grad shape {self.grad.shape} "
                             f"differs from data shape {self.data.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    def zero_grad(self) -> None:
        """Reset the gradient accumulator to zero in place (the array object is kept)."""
        self.grad[...] = 0


GradReadyHook = Callable[[Parameter], None]
"""``hook(param)``: ``param.grad`` is final for this backward call (see the module docstring)."""


class Module:
    """Base class: a differentiable function with named parameters.

    Subclasses implement ``forward`` and ``backward`` and, if they own parameters,
    ``named_parameters``. A container whose parameters become final at different times
    during its backward overrides ``backward_reporting`` to report them as they do.
    """

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        """Return the output and the context ``backward`` needs (never parameter refs)."""
        raise NotImplementedError

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        """Return d(loss)/d(input); add d(loss)/d(param) into each ``param.grad``."""
        raise NotImplementedError

    def backward_reporting(self, ctx: Any, grad_out: np.ndarray,
                           on_grad_ready: GradReadyHook) -> np.ndarray:
        """``backward``, calling ``on_grad_ready(p)`` once per parameter as soon as its
        gradient is final; returns d(loss)/d(input).

        This default runs ``backward`` and then reports the module's parameters (in
        reverse order, the order gradient buckets are filled in). The hook runs on the
        thread running backward; an exception it raises propagates out of backward.
        """
        grad_in = self.backward(ctx, grad_out)
        for p in reversed(self.parameters()):
            on_grad_ready(p)
        return grad_in

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """``(qualified name, parameter)`` pairs in a fixed, deterministic order."""
        return []

    def parameters(self) -> list[Parameter]:
        """The parameters in ``named_parameters`` order."""
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        """Zero every parameter's gradient in place."""
        for p in self.parameters():
            p.zero_grad()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Inference: the forward output without keeping a context."""
        return self.forward(x)[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the parameter arrays keyed by qualified name."""
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy arrays into the parameters in place; names and shapes must match exactly."""
        named = dict(self.named_parameters())
        missing = sorted(set(named) - set(state))
        unexpected = sorted(set(state) - set(named))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, p in named.items():
            value = np.asarray(state[name])
            if value.shape != p.data.shape:
                raise ValueError(f"parameter {name!r}: shape {value.shape} in state dict, "
                                 f"{p.data.shape} in module")
            p.data[...] = value


def _check_input(x: np.ndarray, features: int, who: str) -> None:
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(f"{who}: expected input with last dimension {features}, "
                         f"got shape {x.shape}")


def _init_checks(who: str, rows: int, cols: int, rng: Any, dtype: Any) -> np.dtype[Any]:
    """Check a parametrised layer's sizes, ``rng`` and floating ``dtype``; the dtype."""
    if rows < 1 or cols < 1:
        raise ValueError(f"{who} needs positive sizes, got {rows}x{cols}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    dt = np.dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"{who} needs a floating dtype, got {dt}")
    return dt


class Linear(Module):
    """``y = x @ weight.T + bias`` with weight ``(out_f, in_f)`` and bias ``(out_f,)``.

    Initialised like ``torch.nn.Linear`` (Kaiming-uniform with ``a = sqrt(5)``, which is
    ``U(-1/sqrt(in_f), 1/sqrt(in_f))`` for the weight, and the same bound for the bias),
    drawing the weight first and then the bias from ``rng``. Inputs may have any number
    of leading dimensions.
    """

    def __init__(self, in_features: int, out_features: int, *, rng: np.random.Generator,
                 dtype: Any = np.float64, bias: bool = True) -> None:
        dt = _init_checks("Linear", in_features, out_features, rng, dtype)
        self.in_features = in_features
        self.out_features = out_features
        bound = 1.0 / math.sqrt(in_features)
        weight = rng.uniform(-bound, bound, size=(out_features, in_features)).astype(dt)
        self.weight = Parameter("weight", weight)
        self.bias: Parameter | None = None
        if bias:
            self.bias = Parameter("bias", rng.uniform(-bound, bound, size=out_features).astype(dt))

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        pairs = [("weight", self.weight)]
        if self.bias is not None:
            pairs.append(("bias", self.bias))
        return pairs

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        _check_input(x, self.in_features, "Linear.forward")
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y, x

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        x: np.ndarray = ctx
        g2 = grad_out.reshape(-1, self.out_features)
        x2 = x.reshape(-1, self.in_features)
        self.weight.grad += g2.T @ x2
        if self.bias is not None:
            self.bias.grad += g2.sum(axis=0)
        return grad_out @ self.weight.data

    def __repr__(self) -> str:
        return (f"Linear({self.in_features}, {self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.data.dtype})")


class Embedding(Module):
    """A lookup table: ``y = weight[ids]`` with weight ``(num_embeddings, embedding_dim)``.

    Initialised like ``torch.nn.Embedding``: every entry drawn from N(0, 1) by ``rng``.
    ``ids`` is an integer array of any shape, each id in ``[0, num_embeddings)``; the
    output has shape ``ids.shape + (embedding_dim,)``. Backward adds each row of
    ``grad_out`` into the weight row its id selected (``np.add.at``, so repeated ids
    accumulate). Integer ids have no gradient: backward returns zeros of ``ids.shape``
    (in the weight's dtype), so an ``Embedding`` first in a ``Sequential`` needs nothing
    special.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 rng: np.random.Generator, dtype: Any = np.float64) -> None:
        dt = _init_checks("Embedding", num_embeddings, embedding_dim, rng, dtype)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        weight = rng.standard_normal((num_embeddings, embedding_dim)).astype(dt)
        self.weight = Parameter("weight", weight)

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [("weight", self.weight)]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        ids = np.asarray(x)
        if ids.dtype.kind not in ("i", "u"):
            raise TypeError(f"Embedding.forward: ids must be integers, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(f"Embedding.forward: ids must lie in [0, {self.num_embeddings}), "
                             f"got ids from {ids.min()} to {ids.max()}")
        return self.weight.data[ids], ids

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        ids: np.ndarray = ctx
        np.add.at(self.weight.grad, ids.reshape(-1),
                  grad_out.reshape(-1, self.embedding_dim))
        return np.zeros(ids.shape, self.weight.data.dtype)

    def __repr__(self) -> str:
        return (f"Embedding({self.num_embeddings}, {self.embedding_dim}, "
                f"dtype={self.weight.data.dtype})")


class ReLU(Module):
    """``max(x, 0)``; the gradient at exactly 0 is 0, as in torch."""

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        mask = x > 0
        return np.maximum(x, 0), mask

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        return grad_out * ctx

    def __repr__(self) -> str:
        return "ReLU()"


class Tanh(Module):
    """``tanh(x)``; the backward pass uses the saved output: ``1 - y**2``."""

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        y = np.tanh(x)
        return y, y

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        y: np.ndarray = ctx
        return grad_out * (1 - y * y)

    def __repr__(self) -> str:
        return "Tanh()"


class Sequential(Module):
    """Layers applied in order; the forward context is the list of the layers' contexts.

    Parameters are named ``"<layer index>.<name in layer>"`` like torch, and each
    ``Parameter.name`` is set to that qualified name (nesting composes: ``"1.0.weight"``).
    """

    def __init__(self, *layers: Module) -> None:
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not a Module")
        self.layers: list[Module] = list(layers)
        seen: set[int] = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                raise ValueError(f"parameter {name!r} appears twice in the Sequential")
            seen.add(id(p))
            p.name = name

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [(f"{i}.{name}", p) for i, layer in enumerate(self.layers)
                for name, p in layer.named_parameters()]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        ctxs = []
        for layer in self.layers:
            x, ctx = layer.forward(x)
            ctxs.append(ctx)
        return x, ctxs

    def backward(self, ctx: Any, grad_out: np.ndarray, *,
                 on_grad_ready: GradReadyHook | None = None) -> np.ndarray:
        """Back through the layers in reverse. With ``on_grad_ready``, each parameter is
        reported right after its layer's backward (nested containers report per layer
        too), so the last layers' gradients can travel while earlier layers compute."""
        ctxs: list[Any] = ctx
        if len(ctxs) != len(self.layers):
            raise ValueError(f"context has {len(ctxs)} entries for {len(self.layers)} layers")
        for layer, layer_ctx in zip(reversed(self.layers), reversed(ctxs)):
            if on_grad_ready is None:
                grad_out = layer.backward(layer_ctx, grad_out)
            else:
                grad_out = layer.backward_reporting(layer_ctx, grad_out, on_grad_ready)
        return grad_out

    def backward_reporting(self, ctx: Any, grad_out: np.ndarray,
                           on_grad_ready: GradReadyHook) -> np.ndarray:
        """``backward(ctx, grad_out, on_grad_ready=on_grad_ready)``: layer by layer."""
        return self.backward(ctx, grad_out, on_grad_ready=on_grad_ready)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Module]:
        return iter(self.layers)

    def __getitem__(self, index: int) -> Module:
        return self.layers[index]

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in self.layers)
        return f"Sequential({inner})"


def mlp(sizes: Sequence[int], *, rng: np.random.Generator, dtype: Any = np.float64,
        activation: type[Module] = ReLU) -> Sequential:
    """``Linear -> activation -> ... -> Linear`` through ``sizes`` (no final activation)."""
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least input and output sizes, got {list(sizes)}")
    layers: list[Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(fan_in, fan_out, rng=rng, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(activation())
    return Sequential(*layers)
