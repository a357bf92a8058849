"""Training kit: NumPy layers with hand-written backward passes, losses, SGD/Adam,
demo data with per-rank sharding, and ``distributed_train_step``.

The demo job itself (``netdist.train.demo``) is not imported here: it pulls in the
collectives and the parameter server, and the kit stays usable without them.
"""

from netdist.train.data import (
    Dataset,
    epoch_permutation,
    iterate_batches,
    load_digits_dataset,
    shard_indices,
)
from netdist.train.losses import log_softmax, mse_loss, softmax_cross_entropy
from netdist.train.nn import Linear, Module, Parameter, ReLU, Sequential, Tanh, mlp
from netdist.train.optim import SGD, Adam, Optimizer
from netdist.train.step import GradReady, distributed_train_step

__all__ = [
    "GradReady",
    "Parameter",
    "Module",
    "Linear",
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
]
