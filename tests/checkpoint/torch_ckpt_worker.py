"""One rank of the torch checkpoint acceptance test (``test_torch_state.py``).

Run as ``python -m tests.checkpoint.torch_ckpt_worker MODE CKPT OUT STEPS [SAVE_AT]`` with
``NETDIST_*`` set (a real TCP job on 127.0.0.1). Data-parallel training of a small MLP
whose first layer is trained by SGD (Nesterov momentum, weight decay) and second by Adam
with a StepLR schedule, plus dropout:

- every step draws the global batch from torch's global generator (``torch.randint``)
  and augments it with NumPy's and Python's global generators; all three are equal on
  every rank, so they are stored once, and restoring them (``RNGState``) is what makes a
  resumed run draw the same batches;
- the batch is cut into ``MICRO`` micro-batches (6: divisible by 2 and 3 ranks); each
  rank computes the gradients of its contiguous share (dropout masks from a generator
  seeded by step and micro-batch index, never from a rank's stream), the per-micro-batch
  gradients are ``all_gather``-ed and every rank sums them in micro-batch order. The
  arithmetic is therefore identical at any world size, and a run saved at 2 ranks and
  resumed at 3 must match an uninterrupted run bit for bit.

Modes: ``fresh`` trains steps ``0..STEPS`` from seed 0 and saves collectively after step
``SAVE_AT``; ``resume`` builds a *differently* initialised model and fresh optimizers
(no lazy state), loads the newest checkpoint into them in place and trains to ``STEPS``;
then it does that once more without restoring the generators (``no_rng``), which must
not match. Each rank ``torch.save``s its final state to ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import asyncio
import copy
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from netdist.checkpoint import RNGState, load, save
from netdist.collectives import Group
from netdist.transport.bootstrap import init

MICRO = 6
MICRO_BATCH = 8
FEATURES, HIDDEN, CLASSES, SAMPLES = 12, 16, 5, 240
OP_TIMEOUT = 60.0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, mask_gen: torch.Generator) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        keep = (torch.rand(h.shape, generator=mask_gen) > 0.2).to(h.dtype) / 0.8
        return self.fc2(h * keep)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=-1)


def build(seed: int) -> dict[str, Any]:
    """A model and its optimizers (no optimizer state yet) and schedule."""
    torch.manual_seed(seed)
    model = Net()
    sgd = torch.optim.SGD(model.fc1.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=1e-4)
    adam = torch.optim.Adam(model.fc2.parameters(), lr=0.01, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
    return {"model": model, "sgd": sgd, "adam": adam, "sched": sched}


def seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def draw_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step, from the three global generators."""
    idx = torch.randint(0, SAMPLES, (MICRO * MICRO_BATCH,))
    scale = float(np.random.uniform(0.5, 1.5))
    shift = random.random() - 0.5
    return x[idx] * scale + shift, y[idx]


def micro_gradient(model: Net, xb: torch.Tensor, yb: torch.Tensor, step: int,
                   m: int) -> tuple[np.ndarray, float]:
    """Gradient of micro-batch ``m`` of ``step``, flattened, and its loss."""
    lo, hi = m * MICRO_BATCH, (m + 1) * MICRO_BATCH
    gen = torch.Generator().manual_seed(10_000 * step + m)
    loss = F.cross_entropy(model(xb[lo:hi], gen), yb[lo:hi])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]).numpy(), float(loss.detach())


def apply_gradient(parts: dict[str, Any], grads: np.ndarray) -> None:
    """Sum the micro-batch gradients in micro-batch order, average, step."""
    total = grads[0].copy()
    for m in range(1, MICRO):
        total += grads[m]
    total /= np.float32(MICRO)
    offset = 0
    for p in parts["model"].parameters():
        p.grad = torch.from_numpy(total[offset:offset + p.numel()].copy()).view_as(p)
        offset += p.numel()
    parts["sgd"].step()
    parts["adam"].step()
    parts["sched"].step()


def state_of(parts: dict[str, Any], step: int, *, rng: bool = True) -> dict[str, Any]:
    state = {"model": parts["model"], "sgd": parts["sgd"], "adam": parts["adam"],
             "sched": parts["sched"], "step": step}
    if rng:
        state["rng"] = RNGState()
    return state


def snapshot(parts: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the training state (the optimizers keep mutating theirs)."""
    return copy.deepcopy({"model": parts["model"].state_dict(), "sgd": parts["sgd"].state_dict(),
                          "adam": parts["adam"].state_dict(),
                          "sched": parts["sched"].state_dict()})


async def train(g: Group, parts: dict[str, Any], start: int, steps: int,
                save_at: int | None, ckpt: Path, result: dict[str, Any]) -> list[float]:
    n, r = g.world_size, g.rank
    share = MICRO // n
    x, y = dataset()
    losses = []
    for step in range(start, steps):
        xb, yb = draw_batch(x, y)
        mine = [micro_gradient(parts["model"], xb, yb, step, m)
                for m in range(r * share, (r + 1) * share)]
        gathered = await g.all_gather(np.stack([grad for grad, _ in mine]), timeout=OP_TIMEOUT)
        losses_all = await g.all_gather(np.array([loss for _, loss in mine]),
                                        timeout=OP_TIMEOUT)
        apply_gradient(parts, gathered)
        losses.append(float(losses_all.sum()))
        if save_at is not None and step + 1 == save_at:
            await save(state_of(parts, step + 1), ckpt, g, step=step + 1, timeout=OP_TIMEOUT)
            result["at_save"] = snapshot(parts)
    return losses


async def main(mode: str, ckpt: Path, out: Path, steps: int, save_at: int | None) -> None:
    torch.set_num_threads(1)
    async with init() as transport, Group(transport, timeout=OP_TIMEOUT) as g:
        result: dict[str, Any] = {"world_size": g.world_size}
        if mode == "fresh":
            seed_globals(1234)
            parts = build(seed=0)
            result["losses"] = await train(g, parts, 0, steps, save_at, ckpt, result)
        else:
            seed_globals(777 + g.rank)  # wrong on purpose: the checkpoint must fix it
            parts = build(seed=999)
            loaded = await load(ckpt, g, like=state_of(parts, -1), timeout=OP_TIMEOUT)
            assert loaded["model"] is parts["model"] and loaded["sgd"] is parts["sgd"]
            result["start"] = loaded["step"]
            result["restored"] = snapshot(parts)
            result["losses"] = await train(g, parts, loaded["step"], steps, None, ckpt, result)
            # again, but the generators are not restored: the batches differ
            seed_globals(777 + g.rank)
            other = build(seed=999)
            loaded = await load(ckpt, g, like=state_of(other, -1, rng=False), strict=False,
                                timeout=OP_TIMEOUT)
            await train(g, other, loaded["step"], steps, None, ckpt, {})
            result["no_rng"] = snapshot(other)
        result["final"] = snapshot(parts)
        tmp = out / f".rank{g.rank}.pt.tmp"
        torch.save(result, tmp)
        tmp.rename(out / f"rank{g.rank}.pt")


if __name__ == "__main__":
    mode, ckpt_dir, out_dir, total = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), \
        int(sys.argv[4])
    asyncio.run(main(mode, ckpt_dir, out_dir, total,
                     int(sys.argv[5]) if len(sys.argv) > 5 else None))
