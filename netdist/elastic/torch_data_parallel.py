"""Elastic data parallelism for a torch model and optimizer, wrapped once.

::

    edp = ElasticDataParallel(model, optimizer)
    with netdist.elastic.connect(edp.state(), sampler=sampler) as job:
        while job.step < steps:
            job.run_step(lambda ctx: edp.step(ctx, lambda ids: loss_fn(model(x[ids]), y[ids])))

``step`` runs forward and backward on this member's share of the step's samples, sums
the gradients over the members with netdist's all-reduce on the current epoch's group,
and registers the optimizer update to run only when the step commits. Gradients are
weighted by each member's sample count and divided by the whole step's count, so the
update is the mean over the global batch whatever the membership (as DDP's is with a
fixed one). The state a joiner fetches is the model's ``state_dict`` and the optimizer's
per-parameter tensors (momentum buffers, Adam moments, step counts), flattened to names.

torch is imported only by this module (``netdist[torch]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from netdist.elastic.blocking import BlockingStepContext
from netdist.elastic.state import ElasticState

__all__ = ["ElasticDataParallel"]

_MODEL = "model/"
_OPTIM = "optim/"


class ElasticDataParallel:
    """A torch model and its optimizer, trained data-parallel in an elastic job."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        if any(p.device.type != "cpu" for p in self.params):
            raise ValueError("ElasticDataParallel trains CPU parameters (netdist moves CPU "
                             "memory); move the model to the CPU")

    # -- state ---------------------------------------------------------------------------

    def state(self) -> ElasticState:
        """The model and optimizer state, as the elastic job keeps it in step."""
        return ElasticState(state_dict=self.state_dict, load_state_dict=self.load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        """Flat names to tensors: ``model/<name>`` and ``optim/<index>/<key>``."""
        out: dict[str, Any] = {_MODEL + k: v for k, v in self.model.state_dict().items()}
        index = {id(p): i for i, p in enumerate(self.params)}
        for param, entries in self.optimizer.state.items():
            for key, value in sorted(entries.items()):
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{_OPTIM}{index[id(param)]}/{key}"] = tensor.contiguous()
        return out

    def load_state_dict(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the fetched state (``state_dict``'s names, as NumPy arrays)."""
        model = {k[len(_MODEL):]: torch.from_numpy(np.array(v))
                 for k, v in arrays.items() if k.startswith(_MODEL)}
        self.model.load_state_dict(model)
        state: dict[int, dict[str, Any]] = {}
        for name, value in arrays.items():
            if not name.startswith(_OPTIM):
                continue
            index, key = name[len(_OPTIM):].split("/", 1)
            state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(value))
        saved = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    # -- a step --------------------------------------------------------------------------

    def step(self, ctx: BlockingStepContext,
             loss_fn: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
        """Forward, backward, all-reduce; the optimizer update on commit. ``loss_fn(ids)``
        returns the mean loss over this member's sample ids ``ctx.batch``."""
        ids = ctx.batch
        if ids is None:
            raise ValueError("ElasticDataParallel needs the job's sampler (connect(..., "
                             "sampler=...)) to weight the members' gradients")
        self.optimizer.zero_grad(set_to_none=False)
        if len(ids):
            loss = loss_fn(ids)
            loss.backward()
        else:
            loss = torch.zeros(())
        dtypes = {p.dtype for p in self.params}
        wire = dtypes.pop() if len(dtypes) == 1 else torch.float64
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          .to(wire) for p in self.params]) * len(ids)
        total = ctx.all_reduce(flat.numpy())
        mean = torch.from_numpy(np.asarray(total) / ctx.global_count)

        def commit() -> None:
            offset = 0
            for p in self.params:
                size = p.numel()
                p.grad = mean[offset:offset + size].reshape(p.shape).to(p.dtype).clone()
                offset += size
            self.optimizer.step()

        ctx.on_commit(commit)
        return loss.detach()
