"""Training kit: NumPy layers with hand-written backward passes, losses, SGD/Adam,
demo data with per-rank sharding, and ``distributed_train_step``.

The demo job itself (``netdist.train.digits_job``) is not imported here: it pulls in the
collectives and the parameter server, and the kit stays usable without them.

Names resolve lazily (``netdist._lazy``): importing one module of the kit imports only
what that module needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "GradReady": "netdist.train.step",
    "Parameter": "netdist.train.nn",
    "Module": "netdist.train.nn",
    "Linear": "netdist.train.nn",
    "Embedding": "netdist.train.nn",
    "ReLU": "netdist.train.nn",
    "Tanh": "netdist.train.nn",
    "Sequential": "netdist.train.nn",
    "mlp": "netdist.train.nn",
    "softmax_cross_entropy": "netdist.train.losses",
    "mse_loss": "netdist.train.losses",
    "log_softmax": "netdist.train.losses",
    "Optimizer": "netdist.train.optimizers",
    "SGD": "netdist.train.optimizers",
    "Adam": "netdist.train.optimizers",
    "Dataset": "netdist.train.data",
    "load_digits_dataset": "netdist.train.data",
    "epoch_permutation": "netdist.train.data",
    "shard_indices": "netdist.train.data",
    "iterate_batches": "netdist.train.data",
    "distributed_train_step": "netdist.train.step",
    "placed_state_dict": "netdist.train.mesh_state",
}

__all__ = [
    "GradReady",
    "Parameter",
    "Module",
    "Linear",
    "Embedding",
    "ReLU",
    "Tanh",
    "Sequential",
    "mlp",
    "softmax_cross_entropy",
    "mse_loss",
    "log_softmax",
    "Optimizer",
    "SGD",
    "Adam",
    "Dataset",
    "load_digits_dataset",
    "epoch_permutation",
    "shard_indices",
    "iterate_batches",
    "distributed_train_step",
    "placed_state_dict",
]

if TYPE_CHECKING:
    from netdist.train.data import (
        Dataset,
        epoch_permutation,
        iterate_batches,
        load_digits_dataset,
        shard_indices,
    )
    from netdist.train.losses import log_softmax, mse_loss, softmax_cross_entropy
    from netdist.train.nn import (Embedding, Linear, Module, Parameter, ReLU, Sequential,
                                  Tanh, mlp)
    from netdist.train.optimizers import SGD, Adam, Optimizer
    from netdist.train.mesh_state import placed_state_dict
    from netdist.train.step import GradReady, distributed_train_step
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
