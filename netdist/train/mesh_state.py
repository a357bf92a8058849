"""A model's parameters as a checkpoint state placed on a device mesh.

A model trained on a mesh holds, on each rank, its tensor-parallel layers' shards (split
along ``tp`` as each layer's ``tp_placements`` says) and whole copies of everything else;
every parameter is replicated along the other dimensions (``dp``, and ``pp`` for the
stages that hold it). :func:`placed_state_dict` says exactly that to the checkpoint
layer: one ``ShardedArray`` per parameter, with one placement per mesh dimension, wrapping
the parameter's own array. So ``netdist.checkpoint.save`` writes each byte of the model
once (one replica per piece) and ``load(like=placed_state_dict(...))`` fills the model in
place at any other mesh shape: saved at DP=2 x TP=2, loaded at TP=4, or into one process
with a plain ``model.state_dict()``-like mapping of arrays.

This module composes the training kit with the checkpoint layer (``netdist.train`` is
where layers meet), duck-typing the tensor-parallel layers through ``tp_placements``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from netdist.checkpoint.state import ShardedArray
from netdist.sharding import MeshPlacement, MeshPosition, Replicate

__all__ = ["placed_state_dict", "placed_parameters"]


def placed_parameters(module: Any, prefix: str = ""
                      ) -> Iterator[tuple[str, Any, MeshPlacement]]:
    """``(qualified name, parameter, placement along the tensor-parallel dimension)`` for
    every parameter of ``module``: what a tensor-parallel layer's ``tp_placements`` says,
    ``Replicate()`` for any other layer's parameters. Names are those of
    ``module.named_parameters()`` (``"0.weight"``)."""
    placements = getattr(module, "tp_placements", None)
    layers = getattr(module, "layers", None)
    if placements is None and isinstance(layers, list):
        for index, layer in enumerate(layers):
            yield from placed_parameters(layer, f"{prefix}{index}.")
        return
    for name, param in module.named_parameters():
        placement = placements.get(name, Replicate()) if placements else Replicate()
        yield f"{prefix}{name}", param, placement


def placed_state_dict(module: Any, mesh: Any, *, tp: str | None = "tp"
                      ) -> dict[str, ShardedArray]:
    """Every parameter of ``module`` as a ``ShardedArray`` on ``mesh`` (module docstring).

    ``mesh`` is a ``DeviceMesh`` (or its ``MeshPosition``); ``tp`` names the dimension the
    tensor-parallel layers are split along (``None``: a mesh without one, everything
    replicated). The arrays are the parameters' own (``param.data``), so a load fills the
    model in place. ``KeyError`` naming the mesh's dimensions for an unknown ``tp``.
    """
    position: MeshPosition = mesh if isinstance(mesh, MeshPosition) else mesh.position
    if tp is not None and tp not in position.names:
        raise KeyError(f"the mesh has no dimension {tp!r} (it has "
                       f"{', '.join(position.names)})")
    state = {}
    for name, param, placement in placed_parameters(module):
        placements = tuple(placement if dim == tp else Replicate() for dim in position.names)
        state[name] = ShardedArray(param.data, placements=placements, mesh=position)
    return state
