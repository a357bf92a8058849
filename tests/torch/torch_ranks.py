"""Run one function as N torch.distributed rank processes and collect what each returns.

The higher-layer torch tests (DDP, FSDP2, DCP, pipelining) train the same model twice,
once on Gloo and once on netdist, and compare.  Both runs go through :func:`run_ranks`, so
the only thing that differs between them is the backend name handed to
``init_process_group``.

Each rank is a fresh ``spawn``-ed process (no state leaks from pytest or from the other
run) that calls ``fn(rank, world_size, backend, init_method, out_dir, **kwargs)``.  The
function is pickled by reference, so it must be a module-level function of an importable
module (a test module is fine: the children get the parent's ``sys.path``).  What it
returns travels back through ``out_dir/rank<r>.pt`` (``torch.save`` in the child,
``torch.load(weights_only=True)`` in the parent, so results are tensors, numbers, strings
and lists/dicts of them).  An exception in a child is written to ``out_dir/rank<r>.err``
with its traceback; the parent then gives the other ranks a short grace period to finish
or fail on their own, kills whatever is left, and raises :class:`RankError` carrying every
child's traceback.  A run that outlives its timeout is killed the same way, so a hung
collective fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.ranks import RankError, free_port, run_spawned

__all__ = ["RankError", "free_port", "run_ranks", "init_process_group", "assert_bitwise_equal",
           "synthetic_classification", "train_steps", "CANDIDATE", "RUN_TIMEOUT",
           "COLLECTIVE_TIMEOUT", "TEST_TIMEOUT"]

#: the backend every test compares with the reference run on ``"gloo"``
CANDIDATE = "netdist"
#: seconds a whole run may take before its processes are killed.  A run takes 3-15 s on
#: an idle 2-core machine; the margin is for a machine loaded ten times over, where
#: importing torch alone takes 15 s per process.
RUN_TIMEOUT = 90.0
#: seconds a collective (or the rendezvous) may block in a child before torch's own
#: timeout fires: less than RUN_TIMEOUT, so a hang shows torch's error, not just a kill
COLLECTIVE_TIMEOUT = 75.0
#: pytest timeout for a test that makes two runs (the Gloo one and the netdist one)
TEST_TIMEOUT = 2 * RUN_TIMEOUT + 30.0
#: seconds the surviving ranks get to finish (or fail) after one rank failed
GRACE_AFTER_FAILURE = 5.0


def synthetic_classification(batches: int, batch_size: int, features: int = 64,
                             classes: int = 10, seed: int = 1234,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable classification stream, identical in every process that asks for it.

    Returns ``x`` of shape ``(batches, batch_size, features)`` (standard normal) and labels
    ``y`` of shape ``(batches, batch_size)`` given by a fixed random linear teacher, so a
    small model's loss falls visibly within tens of steps.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches, batch_size, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    return x, (x @ teacher).argmax(dim=-1)


def assert_bitwise_equal(actual: Any, expected: Any, what: str) -> None:
    """Assert two (nested dict/list/tuple of) tensors hold the same bits.

    Stricter than ``torch.equal``: dtypes and shapes must match, ``-0.0`` differs from
    ``0.0`` and a NaN equals the identical NaN.  The message names ``what`` and the first
    differing leaf (by its path through the containers).
    """
    _bitwise(actual, expected, what, "")


def _bitwise(actual: Any, expected: Any, what: str, path: str) -> None:
    where = f"{what}{path}"
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__} is not a dict"
        assert actual.keys() == expected.keys(), \
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _bitwise(actual[key], expected[key], what, f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{where}: {type(actual).__name__} is not a list"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _bitwise(a, e, what, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), \
            f"{where}: {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}"
        a_bits = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e_bits = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a_bits, e_bits):
            differ = (actual.reshape(-1) != expected.reshape(-1)).nonzero()
            if not len(differ):
                raise AssertionError(f"{where}: equal values with different bits "
                                     "(signed zeros or NaN payloads)")
            first = int(differ[0])
            raise AssertionError(
                f"{where}: not bitwise equal; {len(differ)} of {actual.numel()} elements "
                f"differ, first at flat index {first}: {actual.reshape(-1)[first].item()!r} "
                f"!= {expected.reshape(-1)[first].item()!r}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def init_process_group(rank: int, world_size: int, backend: str, init_method: str) -> None:
    """Join the process group the way a plain torch script would, with a bounded timeout.

    ``backend == "netdist"`` imports ``netdist.torch`` first, which is all a torch user
    adds to their script to register the backend.
    """
    if backend == "netdist":
        import netdist.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))


def _torch_rank(rank: int, fn: Callable[..., Any], world_size: int, backend: str,
                init_method: str, out_dir: str, kwargs: dict[str, Any]) -> None:
    """Body of one rank process: run ``fn``, leave the process group, save the result.

    A failure (its traceback in ``rank<r>.err``) and the exit are ``run_spawned``'s.
    """
    # One intra-op thread per process: 2-core machines, and both runs must take the same
    # floating-point paths for the bitwise comparisons.
    torch.set_num_threads(1)
    result = fn(rank, world_size, backend, init_method, out_dir, **kwargs)
    if dist.is_initialized():
        dist.destroy_process_group()
    out = Path(out_dir)
    tmp = out / f"rank{rank}.pt.tmp"
    torch.save(result, tmp)
    tmp.rename(out / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., Any], world_size: int, backend: str, out_dir: Path,
              timeout: float = RUN_TIMEOUT, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` fresh rank processes; return each rank's result.

    ``fn(rank, world_size, backend, init_method, out_dir, **kwargs)`` is called in every
    child with a ``tcp://127.0.0.1:<free port>`` init method and ``out_dir`` (created here;
    the function may leave files there, e.g. a checkpoint).  Returns the list of return
    values, indexed by rank.  Raises :class:`RankError` with every failing child's
    traceback if any child raises, dies, or the run exceeds ``timeout`` seconds; no child
    outlives this call (``tests.ranks.run_spawned`` starts and watches the processes).
    """
    init_method = f"tcp://127.0.0.1:{free_port()}"
    run_spawned(_torch_rank, world_size, out_dir,
                args=(fn, world_size, backend, init_method, str(out_dir), kwargs),
                timeout=timeout, grace=GRACE_AFTER_FAILURE,
                what=f"{backend} run of {fn.__name__} on {world_size} ranks")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True)
            for rank in range(world_size)]


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int,
                world_size: int, steps: int, per_rank_batch: int,
                seed: int = 1234) -> torch.Tensor:
    """``steps`` optimizer steps on this rank's share of each global batch of the
    synthetic stream; returns the local losses."""
    x, y = synthetic_classification(steps, world_size * per_rank_batch, seed=seed)
    rows = slice(rank * per_rank_batch, (rank + 1) * per_rank_batch)
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x[step, rows]), y[step, rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)
