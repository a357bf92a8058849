"""A torch model trained with DiLoCo: the worker (one rank over TCP) and the reference.

``python -m tests.parallel._diloco_torch OUT_DIR [QUANTIZE]`` is one rank of a real job
(``netdist.connect()``: the exchanges run on the progress thread while this thread takes
the next inner steps), AdamW as the inner optimizer, 2 fragments with one step of delay.
It writes ``rank_N.npz`` (the global and local parameters) and prints ``DONE``.
``reference(world)`` computes what every worker must end with, in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

STEPS = 23
CONFIG = dict(sync_every=6, fragments=2, fragment_sync_delay=1, outer_lr=0.7,
              outer_momentum=0.9)


def make_model(torch: object) -> object:
    import torch as t

    t.manual_seed(0)
    return t.nn.Sequential(t.nn.Linear(8, 16), t.nn.Tanh(), t.nn.Linear(16, 4))


def batch(rank: int, step: int) -> tuple[object, object]:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(5, 8, generator=g)
    return x, torch.sin(x[:, :4] * (rank + 1))


def inner_step(model: object, optimizer: object, rank: int, step: int) -> None:
    import torch

    x, y = batch(rank, step)
    optimizer.zero_grad()  # type: ignore[attr-defined]
    loss = torch.nn.functional.mse_loss(model(x), y)  # type: ignore[operator]
    loss.backward()
    optimizer.step()  # type: ignore[attr-defined]


def main(out_dir: str, quantize: str | None) -> None:
    import torch

    import netdist
    from netdist.parallel.diloco import DiLoCo, DiLoCoConfig

    torch.set_num_threads(1)
    model = make_model(torch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # type: ignore[attr-defined]
    with netdist.connect() as job:
        diloco = job.make(DiLoCo, job.group, list(model.parameters()),  # type: ignore[attr-defined]
                          DiLoCoConfig(quantization=quantize, **CONFIG))
        for step in range(1, STEPS + 1):
            inner_step(model, optimizer, job.rank, step)
            diloco.step()
        diloco.finish()
        global_ = [np.array(a) for a in diloco.global_arrays()]
        local = [p.detach().numpy().copy() for p in model.parameters()]  # type: ignore[attr-defined]
        records = diloco.records
        np.savez(Path(out_dir, f"rank_{job.rank}.npz"),
                 *global_, *local, launched=np.array([r.launched_after for r in records]))
    print("DONE", flush=True)


def reference(world: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Every worker's AdamW steps and the DiLoCo schedule in one process (float32, the
    same operations in the same order as ``DiLoCo`` and ``OuterSGD``)."""
    import torch

    from netdist.parallel.fragments import FragmentSchedule, split_fragments

    torch.set_num_threads(1)
    models = [make_model(torch) for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]  # type: ignore[attr-defined]
    params = [[p.detach().numpy() for p in m.parameters()] for m in models]  # type: ignore[attr-defined]
    global_ = [p.copy() for p in params[0]]
    buffers = [np.zeros_like(g) for g in global_]
    schedule = FragmentSchedule(CONFIG["sync_every"], CONFIG["fragments"],
                                CONFIG["fragment_sync_delay"])
    parts = split_fragments([g.size for g in global_], CONFIG["fragments"])
    pending: dict[int, list[np.ndarray]] = {}
    m, lr = np.float32(CONFIG["outer_momentum"]), np.float32(CONFIG["outer_lr"])

    def complete(p: int) -> None:
        avg = pending.pop(p)
        for j, i in enumerate(parts[p]):
            buffers[i] *= m
            buffers[i] += avg[j]
            global_[i] -= lr * (avg[j] + m * buffers[i])
            for w in range(world):
                np.copyto(params[w][i], global_[i])

    for step in range(1, STEPS + 1):
        for w in range(world):
            inner_step(models[w], opts[w], w, step)
        for p in schedule.completed_after(step):
            complete(p)
        for p in schedule.launched_after(step):
            diffs = [[global_[i] - params[w][i] for i in parts[p]] for w in range(world)]
            pending[p] = [(diffs[0][j] + diffs[1][j]) / np.float32(world)
                          for j in range(len(parts[p]))]
    for p in sorted(pending):
        complete(p)
    return global_, params


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
