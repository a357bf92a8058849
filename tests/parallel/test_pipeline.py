"""The pipeline runtime: equivalence with single-process training, 2-D, failures."""

from __future__ import annotations

import asyncio
import functools
import signal
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.errors import NetdistTimeoutError, PeerLostError, PipelineError
from netdist.parallel.pipeline import (
    PipelineParallel,
    measure_layer_costs,
    stash_nbytes,
    train_pipelined,
)
from netdist.parallel.stages import (
    PipelineParallelConfig,
    balance_stages,
    parameter_costs,
    split_into_stages,
)
from netdist.train.losses import mse_loss, softmax_cross_entropy
from netdist.train.nn import Sequential, mlp
from netdist.train.optimizers import SGD, Adam
from netdist.transport.inprocess import InProcessTransport
from tests import ranks

SIZES = [6, 16, 12, 10, 3]  # mlp -> 7 layers: L R L R L R L
NUM_LAYERS = 2 * (len(SIZES) - 1) - 1
STEPS = 3
TIMEOUT = 20.0


def require(module: str, name: str) -> Any:
    """The module if it already provides ``name`` (other parts land concurrently)."""
    mod = pytest.importorskip(module)
    if not hasattr(mod, name):
        pytest.skip(f"{module}.{name} not built yet")
    return mod


def make_model() -> Sequential:
    return mlp(SIZES, rng=np.random.default_rng(1234), dtype=np.float64)


def make_batches(batch: int, steps: int = STEPS, seed: int = 7) -> list[tuple[np.ndarray,
                                                                              np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, SIZES[0])), rng.integers(0, SIZES[-1], batch))
            for _ in range(steps)]


def sgd(params: list[Any]) -> SGD:
    return SGD(params, lr=0.1, momentum=0.9)


def adam(params: list[Any]) -> Adam:
    return Adam(params, lr=0.01)


def reference_training(batches: Sequence[tuple[np.ndarray, np.ndarray]],
                       optimizer_factory: Callable[[list[Any]], Any]
                       ) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """Single-process training on the full mini-batches: parameters after every step."""
    model = make_model()
    optimizer = optimizer_factory(model.parameters())
    states, losses = [], []
    for x, y in batches:
        model.zero_grad()
        logits, ctx = model.forward(x)
        loss, grad = softmax_cross_entropy(logits, y)
        model.backward(ctx, grad)
        optimizer.step()
        states.append(model.state_dict())
        losses.append(loss)
    return states, losses


run_ranks = functools.partial(ranks.run_ranks, with_rank=True, as_groups=False, close=True,
                              guard=110.0)
"""``await run_ranks(transports, body)``: ``body(rank, transport)`` on every rank
concurrently, within the test's own time limit; all transports closed afterwards."""


async def pipelined_training(transports: Sequence[Any], config: PipelineParallelConfig,
                             batches: Sequence[tuple[np.ndarray, np.ndarray]],
                             optimizer_factory: Callable[[list[Any]], Any],
                             stages: Any = None, offload: bool = False) -> tuple[list[list[dict[str, np.ndarray]]],
                                                          list[list[float | None]],
                                                          list[PipelineParallel]]:
    """Every rank trains its stage; returns per rank the per-step stage states and losses."""
    if stages is None:
        stages = split_into_stages(NUM_LAYERS, config.num_stages)
    pipes: list[PipelineParallel] = [None] * len(transports)  # type: ignore[list-item]

    async def body(rank: int, transport: Any) -> tuple[list[dict[str, np.ndarray]],
                                                        list[float | None]]:
        model = make_model()  # every rank builds the same model and keeps its slice
        stage = stages[config.stage_of(rank)]
        replica = config.replica_of(rank)
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy,
                                optimizer_factory=optimizer_factory, timeout=TIMEOUT,
                                offload_compute=offload)
        pipes[rank] = pipe
        states, losses = [], []
        for x, y in batches:
            rows = len(x) // config.data_parallel_size
            xs = x[replica * rows:(replica + 1) * rows]
            ys = y[replica * rows:(replica + 1) * rows]
            losses.append(await pipe.train_step(xs if pipe.is_first else None,
                                                ys if pipe.is_last else None))
            states.append({name: p.data.copy() for name, p in model.named_parameters()
                           if any(p is q for q in pipe.parameters)})
        return states, losses

    results = await run_ranks(transports, body)
    return [r[0] for r in results], [r[1] for r in results], pipes


def assert_matches_reference(config: PipelineParallelConfig,
                             per_rank_states: list[list[dict[str, np.ndarray]]],
                             per_rank_losses: list[list[float | None]],
                             ref_states: list[dict[str, np.ndarray]],
                             ref_losses: list[float]) -> None:
    for step, ref in enumerate(ref_states):
        for replica in range(config.data_parallel_size):
            seen: dict[str, np.ndarray] = {}
            for stage in range(config.num_stages):
                seen.update(per_rank_states[config.rank_of(stage, replica)][step])
            assert sorted(seen) == sorted(ref)  # the stages together hold every parameter
            for name, value in ref.items():
                diff = float(np.max(np.abs(seen[name] - value)))
                assert diff <= 1e-12, f"step {step} replica {replica} {name}: {diff}"
    for rank, losses in enumerate(per_rank_losses):
        if config.stage_of(rank) == config.num_stages - 1:
            if config.data_parallel_size == 1:
                assert losses == pytest.approx(ref_losses, abs=1e-12)
            else:
                assert all(isinstance(loss, float) for loss in losses)
        else:
            assert losses == [None] * len(ref_losses)


# -- equivalence with single-process training ---------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 7])
async def test_pipelined_mlp_matches_single_process(schedule: str, num_stages: int) -> None:
    config = PipelineParallelConfig(num_stages, num_micro_batches=4, schedule=schedule)
    batches = make_batches(batch=12)
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = InProcessTransport.create_group(num_stages, timeout=TIMEOUT)
    states, losses, pipes = await pipelined_training(transports, config, batches, sgd)
    assert_matches_reference(config, states, losses, ref_states, ref_losses)
    for pipe in pipes:
        stats = pipe.last_stats
        assert stats is not None and stats.step == STEPS - 1
        expected = 4 if schedule == "gpipe" else min(num_stages - pipe.stage, 4)
        assert stats.peak_stashed_micro_batches == expected


@pytest.mark.parametrize(("schedule", "offload"), [("gpipe", False), ("1f1b", True)])
async def test_uneven_micro_batches_and_adam_match_single_process(schedule: str,
                                                                  offload: bool) -> None:
    # 10 rows in 4 micro-batches: 3, 3, 2, 2 rows, each loss weighted by rows / 10;
    # offload_compute runs forward/backward in worker threads: same numbers
    config = PipelineParallelConfig(3, num_micro_batches=4, schedule=schedule)
    batches = make_batches(batch=10)
    ref_states, ref_losses = reference_training(batches, adam)
    transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
    states, losses, _ = await pipelined_training(transports, config, batches, adam,
                                                 offload=offload)
    assert_matches_reference(config, states, losses, ref_states, ref_losses)


async def test_balanced_stages_match_single_process() -> None:
    config = PipelineParallelConfig(3, num_micro_batches=2, schedule="1f1b")
    stages = balance_stages(parameter_costs(make_model().layers), 3)
    # parameter counts [112, 0, 204, 0, 130, 0, 33]: the 204-parameter layer sets the pace
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 2), (2, 4), (4, 7)]
    batches = make_batches(batch=8)
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
    states, losses, _ = await pipelined_training(transports, config, batches, sgd, stages)
    assert_matches_reference(config, states, losses, ref_states, ref_losses)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_two_stages_times_two_replicas_matches_single_process(schedule: str) -> None:
    require("netdist.collectives", "Group")
    config = PipelineParallelConfig(2, num_micro_batches=4, schedule=schedule,
                                    data_parallel_size=2)
    batches = make_batches(batch=16)  # 8 rows per replica, 2 per micro-batch
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = InProcessTransport.create_group(4, timeout=TIMEOUT)
    states, losses, _ = await pipelined_training(transports, config, batches, sgd)
    assert_matches_reference(config, states, losses, ref_states, ref_losses)
    # the replicas' losses average to the global mini-batch loss
    for step, ref in enumerate(ref_losses):
        replica_losses = [losses[config.rank_of(1, r)][step] for r in range(2)]
        assert sum(replica_losses) / 2 == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize(("num_stages", "replicas", "schedule"),
                         [(3, 1, "1f1b"), (2, 2, "gpipe")])
async def test_pipeline_over_real_tcp_matches_single_process(num_stages: int, replicas: int,
                                                             schedule: str) -> None:
    local = require("netdist.transport.local_tcp", "create_local_tcp_group")
    if replicas > 1:
        require("netdist.collectives", "Group")
    config = PipelineParallelConfig(num_stages, num_micro_batches=4, schedule=schedule,
                                    data_parallel_size=replicas)
    batches = make_batches(batch=16)
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = await local.create_local_tcp_group(config.world_size, timeout=TIMEOUT)
    states, losses, _ = await pipelined_training(transports, config, batches, sgd)
    assert_matches_reference(config, states, losses, ref_states, ref_losses)


async def test_train_pipelined_matches_single_process() -> None:
    config = PipelineParallelConfig(2, num_micro_batches=3, schedule="1f1b")
    batches = make_batches(batch=9)
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    models = [make_model() for _ in transports]

    seen_steps: list[tuple[int, int, float | None]] = []
    x_test = make_batches(batch=5, steps=1, seed=99)[0][0]

    async def body(rank: int, transport: Any) -> Any:
        result = await train_pipelined(
            transport, models[rank].layers, batches, config, loss_fn=softmax_cross_entropy,
            optimizer_factory=sgd, timeout=TIMEOUT,
            on_step=lambda step, loss: seen_steps.append((rank, step, loss)))
        predicted = await result.pipeline.predict(x_test if rank == 0 else None)
        return result, predicted

    (first, pred0), (last, pred1) = await run_ranks(transports, body)
    assert first.losses == (None,) * STEPS and pred0 is None
    assert list(last.losses) == pytest.approx(ref_losses, abs=1e-12)
    assert sorted((r, s) for r, s, _ in seen_steps) == [(r, s) for r in (0, 1)
                                                        for s in range(STEPS)]
    stages = split_into_stages(NUM_LAYERS, 2)
    assert (first.stage, last.stage) == (stages[0], stages[1])
    final = ref_states[-1]
    for rank, stage in enumerate(stages):
        for layer in stage.select(models[rank].layers):
            for p in layer.parameters():
                assert np.max(np.abs(p.data - final[p.name])) <= 1e-12
    reference = make_model()
    reference.load_state_dict(final)
    np.testing.assert_allclose(pred1, reference(x_test), rtol=0, atol=1e-12)


async def test_pipeline_inside_a_subgroup_uses_its_rank_order() -> None:
    """A pipeline over group ranks [2, 0] of a 3-rank world: stage 0 on transport rank 2."""
    collectives = require("netdist.collectives", "Group")
    config = PipelineParallelConfig(2, num_micro_batches=2, schedule="1f1b")
    batches = make_batches(batch=6)
    ref_states, ref_losses = reference_training(batches, sgd)
    transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 2)

    async def body(rank: int, transport: Any) -> Any:
        sub = collectives.Group(transport, timeout=TIMEOUT).new_group([2, 0])
        if not sub.is_member:
            return None
        model = make_model()
        stage = stages[sub.rank]
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy, optimizer_factory=sgd,
                                group=sub, timeout=TIMEOUT)
        assert (pipe.prev_rank, pipe.next_rank) == ((None, 0) if rank == 2 else (2, None))
        losses = [await pipe.train_step(x, y) for x, y in batches]
        return losses, {p.name: p.data.copy() for p in pipe.parameters}

    results = await run_ranks(transports, body)
    assert results[1] is None
    with pytest.raises(PipelineError, match="not a member of the pipeline's group"):
        outsider = InProcessTransport.create_group(3, timeout=TIMEOUT)
        sub = collectives.Group(outsider[1]).new_group([2, 0])
        PipelineParallel(outsider[1], stages[0].select(make_model().layers), config,
                         group=sub)
    assert results[2][0] == [None] * STEPS
    assert results[0][0] == pytest.approx(ref_losses, abs=1e-12)
    merged = {**results[0][1], **results[2][1]}
    for name, value in ref_states[-1].items():
        assert np.max(np.abs(merged[name] - value)) <= 1e-12


async def test_mse_regression_and_predict() -> None:
    config = PipelineParallelConfig(2, num_micro_batches=2, schedule="gpipe")
    rng = np.random.default_rng(3)
    x, target = rng.standard_normal((6, 6)), rng.standard_normal((6, 3))
    reference = make_model()
    logits, ctx = reference.forward(x)
    loss, grad = mse_loss(logits, target)
    reference.backward(ctx, grad)
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 2)

    async def body(rank: int, transport: Any) -> Any:
        model = make_model()
        pipe = PipelineParallel(transport, stages[rank].select(model.layers), config,
                                loss_fn=mse_loss, timeout=TIMEOUT)
        got = await pipe.forward_backward(x, target)  # no optimizer: grads stay
        for layer in stages[rank].select(model.layers):
            for p in layer.parameters():
                ref_p = dict(reference.named_parameters())[p.name]
                assert np.max(np.abs(p.grad - ref_p.grad)) <= 1e-12
        predicted = await pipe.predict(x if pipe.is_first else None)
        return got, predicted

    (loss0, pred0), (loss1, pred1) = await run_ranks(transports, body)
    assert loss0 is None and pred0 is None
    assert loss1 == pytest.approx(loss, abs=1e-12)
    np.testing.assert_allclose(pred1, reference(x), rtol=0, atol=1e-12)


async def test_activation_stash_gpipe_grows_with_m_1f1b_does_not() -> None:
    peaks: dict[tuple[str, int], list[int]] = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 8):
            config = PipelineParallelConfig(3, num_micro_batches=m, schedule=schedule)
            transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
            _, _, pipes = await pipelined_training(transports, config,
                                                   make_batches(batch=16, steps=1), sgd)
            peaks[schedule, m] = [p.last_stats.peak_stash_bytes for p in pipes]  # type: ignore[union-attr]
            counts = [p.last_stats.peak_stashed_micro_batches for p in pipes]  # type: ignore[union-attr]
            assert counts == ([m] * 3 if schedule == "gpipe" else [min(3 - s, m) for s in range(3)])
    # same rows per stash in total for gpipe: m micro-batches of 16/m rows
    assert peaks["gpipe", 8] == peaks["gpipe", 2]
    # 1F1B with more micro-batches holds fewer rows: at most 3 of 8 micro-batches of 2 rows
    for stage in range(3):
        assert peaks["1f1b", 8][stage] < peaks["gpipe", 8][stage]
    assert peaks["1f1b", 8][0] * 8 == peaks["gpipe", 8][0] * 3


def test_measured_layer_costs_feed_balance_and_leave_grads_alone() -> None:
    model = make_model()
    for p in model.parameters():
        p.grad[...] = 1.5
    sample = np.random.default_rng(0).standard_normal((32, SIZES[0]))
    costs = measure_layer_costs(model.layers, sample, repeats=2)
    assert len(costs) == NUM_LAYERS and all(c > 0 for c in costs)
    assert all(np.all(p.grad == 1.5) for p in model.parameters())
    stages = balance_stages(costs, 3)
    assert [s.rank for s in stages] == [0, 1, 2] and stages[-1].end_layer == NUM_LAYERS
    with pytest.raises(ValueError, match="repeats"):
        measure_layer_costs(model.layers, sample, repeats=0)


def test_stash_nbytes_counts_each_buffer_once() -> None:
    a = np.zeros((4, 8))
    mask = a > 0
    assert stash_nbytes([a, (a, mask), {"x": a[:2]}]) == a.nbytes + mask.nbytes + a[:2].nbytes
    assert stash_nbytes(None) == 0


# -- validation ---------------------------------------------------------------------------

async def test_validation_errors_up_front() -> None:
    transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
    model = make_model()
    try:
        with pytest.raises(PipelineError, match=r"2 \* 1 = 2 ranks, got world size 3"):
            PipelineParallel(transports[0], model.layers[:3], PipelineParallelConfig(2, 2))
        with pytest.raises(PipelineError, match="last stage.*pass loss_fn"):
            PipelineParallel(transports[2], model.layers[5:], PipelineParallelConfig(3, 2))
        with pytest.raises(TypeError, match="Module API"):
            PipelineParallel(transports[0], [object()], PipelineParallelConfig(3, 2))
        with pytest.raises(ValueError, match="too large"):
            PipelineParallel(transports[0], model.layers[:3], PipelineParallelConfig(3, 10**6))
        first = PipelineParallel(transports[0], model.layers[:3], PipelineParallelConfig(3, 4))
        with pytest.raises(PipelineError, match="first stage: pass inputs"):
            await first.train_step(None, None)
        with pytest.raises(PipelineError, match="3 rows cannot be split into 4"):
            await first.train_step(np.zeros((3, 6)))
    finally:
        for t in transports:
            await t.aclose()


async def test_mismatched_configuration_between_stages_is_reported() -> None:
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 2)
    configs = [PipelineParallelConfig(2, 4, "gpipe"), PipelineParallelConfig(2, 2, "gpipe")]
    x, y = make_batches(batch=8, steps=1)[0]

    async def body(rank: int, transport: Any) -> Any:
        model = make_model()
        pipe = PipelineParallel(transport, stages[rank].select(model.layers), configs[rank],
                                loss_fn=softmax_cross_entropy, timeout=TIMEOUT)
        return await pipe.train_step(x, y)

    with pytest.raises(PipelineError, match="configuration mismatch between rank"):
        await run_ranks(transports, body)


async def test_batch_size_mismatch_between_inputs_and_targets() -> None:
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 2)
    config = PipelineParallelConfig(2, 2)
    x, y = make_batches(batch=8, steps=1)[0]

    async def body(rank: int, transport: Any) -> Any:
        model = make_model()
        pipe = PipelineParallel(transport, stages[rank].select(model.layers), config,
                                loss_fn=softmax_cross_entropy, timeout=TIMEOUT)
        if rank == 0:
            return await pipe.train_step(x, None)
        try:
            return await pipe.train_step(None, y[:6])
        finally:
            await transport.aclose()  # the failing stage goes away, as its process would

    with pytest.raises(PipelineError, match="4 activation rows for 3 target rows"):
        await run_ranks(transports, body)


# -- failures -----------------------------------------------------------------------------

async def test_lost_stage_makes_its_neighbours_raise_peer_lost() -> None:
    config = PipelineParallelConfig(3, num_micro_batches=4, schedule="1f1b")
    transports = InProcessTransport.create_group(3, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 3)
    x, y = make_batches(batch=8, steps=1)[0]
    dying = asyncio.Event()

    class Dies:
        """A layer that closes its rank's transport during the second micro-batch."""

        def __init__(self) -> None:
            self.calls = 0

        def forward(self, value: np.ndarray) -> tuple[np.ndarray, None]:
            self.calls += 1
            if self.calls == 2:
                dying.set()
            return value, None

        def backward(self, ctx: None, grad: np.ndarray) -> np.ndarray:
            return grad

        def parameters(self) -> list[Any]:
            return []

    async def body(rank: int, transport: Any) -> Any:
        model = make_model()
        layers = stages[rank].select(model.layers)
        if rank == 1:
            layers = [*layers, Dies()]
        pipe = PipelineParallel(transport, layers, config, loss_fn=softmax_cross_entropy,
                                timeout=TIMEOUT)
        if rank == 1:
            step = asyncio.ensure_future(pipe.train_step())
            await dying.wait()
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            await transport.aclose()  # "killed": its peers see the connection go
            return "killed"
        started = time.monotonic()
        try:
            await pipe.train_step(x, y)
        except PeerLostError as exc:
            return exc, time.monotonic() - started
        return None

    results = await run_ranks(transports, body)
    assert results[1] == "killed"
    for rank in (0, 2):
        exc, elapsed = results[rank]
        assert isinstance(exc, PeerLostError) and exc.rank == 1
        assert elapsed < TIMEOUT
        assert any(f"pipeline rank {rank} (stage {rank}" in note for note in exc.__notes__)


async def test_silent_stage_makes_its_neighbour_time_out_naming_it() -> None:
    config = PipelineParallelConfig(2, num_micro_batches=2)
    transports = InProcessTransport.create_group(2, timeout=TIMEOUT)
    stages = split_into_stages(NUM_LAYERS, 2)
    x, _ = make_batches(batch=4, steps=1)[0]
    try:
        pipe = PipelineParallel(transports[0], stages[0].select(make_model().layers), config,
                                timeout=0.2)
        started = time.monotonic()
        with pytest.raises(NetdistTimeoutError, match="from rank 1") as info:
            await pipe.train_step(x)  # rank 1 never joins
        assert time.monotonic() - started < 5
        assert any("pipeline rank 0" in note for note in info.value.__notes__)
    finally:
        for t in transports:
            await t.aclose()


KILL_SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, time
    import numpy as np
    try:
        from netdist import init
    except ImportError:  # before the top-level export lands
        from netdist.transport.bootstrap import init
    from netdist.parallel.pipeline import PipelineParallel
    from netdist.parallel.stages import PipelineParallelConfig, split_into_stages
    from netdist.train.losses import softmax_cross_entropy
    from netdist.train.nn import mlp
    from netdist.train.optimizers import SGD

    SIZES = [6, 16, 12, 10, 3]
    VICTIM = int(sys.argv[1])

    class Hang:
        # on the victim stage, blocks the whole process in the second micro-batch of the
        # second step (4 micro-batches per step) so the test can SIGKILL it mid-step
        def __init__(self):
            self.calls = 0
        def forward(self, x):
            self.calls += 1
            if self.calls == 4 + 2:
                print("VICTIM-MID-STEP", flush=True)
                time.sleep(3600)
            return x, None
        def backward(self, ctx, g):
            return g
        def parameters(self):
            return []

    async def main():
        async with init() as transport:
            rank = transport.rank
            config = PipelineParallelConfig(3, num_micro_batches=4, schedule="1f1b")
            model = mlp(SIZES, rng=np.random.default_rng(0))
            stage = split_into_stages(len(model.layers), 3)[rank]
            layers = stage.select(model.layers)
            if rank == VICTIM:
                layers.append(Hang())
            pipe = PipelineParallel(transport, layers, config,
                                    loss_fn=softmax_cross_entropy,
                                    optimizer_factory=lambda ps: SGD(ps, lr=0.1),
                                    timeout=float(os.environ["PIPE_TIMEOUT"]))
            rng = np.random.default_rng(1)
            x, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
            await pipe.train_step(x, y)  # a full step works
            print("STEP-OK", flush=True)
            started = time.monotonic()
            try:
                await pipe.train_step(x, y)
            except Exception as exc:
                print(f"RAISED {type(exc).__name__} after {time.monotonic() - started:.2f}s: "
                      f"{exc}", flush=True)
                sys.exit(3)
            print("NO-ERROR", flush=True)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_sigkilled_stage_process_makes_the_others_raise(tmp_path: Path) -> None:
    require("netdist.transport.bootstrap", "init")
    script = tmp_path / "pipe_kill.py"
    script.write_text(KILL_SCRIPT)
    victim, world, pipe_timeout = 1, 3, 15.0
    coordinator, token = f"127.0.0.1:{ranks.free_port()}", "pipe-kill-test"

    def env(rank: int) -> dict[str, str]:
        return dict(ranks.rank_env(rank, world, coordinator, token, "pipe-kill"),
                    PIPE_TIMEOUT=str(pipe_timeout))

    procs = ranks.start_processes([[str(script), str(victim)]] * world, env=env)
    try:
        procs[victim].expect("VICTIM-MID-STEP", timeout=60)
        killed_at = time.monotonic()
        procs[victim].proc.send_signal(signal.SIGKILL)
        survivors = ranks.finish_ranks([p for p in procs if p.rank != victim],
                                       timeout=pipe_timeout + 20)
        elapsed = time.monotonic() - killed_at
        for done in survivors:
            out = done.stdout
            assert done.returncode == 3, out
            assert "STEP-OK" in out and "RAISED" in out, out
            # the victim's sockets close with the process: a lost peer, not a timeout
            assert "RAISED PeerLostError" in out, out
            assert "rank 1" in out, out
        assert elapsed < pipe_timeout, [done.stdout for done in survivors]
    finally:
        for proc in procs:
            proc.kill()
