"""What ``examples/slurm/ddp_train.py`` must end with, computed in this one process.

DDP averages the gradients of every rank's mean loss; with equal batches that is the
gradient of the mean loss over all ranks' samples at once. So one model trained here on
every rank's batches of each step, with the script's own model, data and optimizer
settings, must end with the weights every DDP replica ends with (up to float32 rounding:
the sums are ordered differently).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["DDP_SCRIPT", "DdpLine", "parse_ddp_lines", "reference_weights_sum"]

DDP_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "ddp_train.py"
_LINE = re.compile(r"^rank (\d+) of (\d+) on (\S+) \((\w+)\): loss ([0-9.]+), "
                   r"replicas identical: (True|False), weights sum (-?[0-9.]+)$", re.M)


@dataclass(frozen=True, slots=True)
class DdpLine:
    """One rank's last line."""

    rank: int
    world: int
    host: str
    backend: str
    identical: bool
    weights_sum: float


def parse_ddp_lines(text: str) -> list[DdpLine]:
    """Every rank's line in ``text``, by rank."""
    lines = [DdpLine(int(m[1]), int(m[2]), m[3], m[4], m[6] == "True", float(m[7]))
             for m in _LINE.finditer(text)]
    return sorted(lines, key=lambda line: line.rank)


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddp_train_example", DDP_SCRIPT)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {DDP_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the functions; main() runs only as __main__
    return module


def reference_weights_sum(world: int) -> float:
    """The sum of the weights ``world`` DDP ranks of the script end with."""
    import torch

    script = _script()
    model = script.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR)
    for step in range(script.STEPS):
        batches = [script.batch(rank, step) for rank in range(world)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return float(torch.cat([p.detach().flatten() for p in model.parameters()])
                 .double().sum().item())
