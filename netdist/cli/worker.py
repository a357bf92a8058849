"""``netdist worker [flags]``: run one rank of the digits demo job.

This is what containers and remote machines run: the rank, world size, coordinator and
token come from the environment (``NETDIST_*``, torchrun/Slurm/MPI variables; see
``netdist.init``). ``netdist demo`` starts several of these locally.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from netdist.parallel.schedule import ScheduleKind

if TYPE_CHECKING:
    from netdist.train.digits_job import DemoConfig

__all__ = ["add_parser", "run", "add_training_flags", "config_from_args", "training_argv"]

_AGGREGATORS = ("ring", "topk", "fp16", "ps", "ps-sharded", "ps-async", "diloco", "local-sgd")

_EPILOG = """\
aggregators:
  ring        bucketed all-reduce of dense gradients (default)
  topk        top-k sparsified gradients with error feedback, all-gathered
  fp16        bucketed all-reduce in float16
  ps          synchronous parameter server on rank 0
  ps-sharded  parameters partitioned across servers on the first ranks, SGD there
  ps-async    the same, asynchronous with bounded staleness

pipeline parallelism (--pipeline-stages P):
  the world size must be a multiple of P: the ranks form world/P replicas of a P-stage
  pipeline (rank = replica * P + stage), each holding a slice of the MLP's layers; each
  stage's gradients are all-reduced over its replicas, rank 0 reports the loss (from
  the last stages) and the test accuracy (evaluated on the last stage of replica 0).
  --batch-size counts samples per replica. Supported with --aggregator ring only and
  without --checkpoint-dir / --checkpoint-every / --resume (refused with an error).

parameter-server settings come from the environment:
  NETDIST_PS_SERVERS=S         server ranks for ps-sharded / ps-async, which also train
                               (default 2, or fewer in a job too small to keep a worker:
                               1 in a 1-rank job)
  NETDIST_PS_MAX_STALENESS=K   ps-async staleness bound, or "none" (default 2)

example (one rank of a 2-rank job, the other started the same way with rank 1):
  NETDIST_RANK=0 NETDIST_WORLD_SIZE=2 NETDIST_COORDINATOR=10.0.0.1:29500 \\
  NETDIST_TOKEN=secret netdist worker --aggregator topk --epochs 20
"""


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The training flags shared by ``worker`` and ``demo``."""
    g = parser.add_argument_group("training")
    g.add_argument("--aggregator", choices=_AGGREGATORS, default="ring",
                   help="how gradients are averaged (default: ring)")
    g.add_argument("--epochs", type=int, default=20, help="passes over the data (default 20)")
    g.add_argument("--batch-size", type=int, default=32, metavar="B",
                   help="samples per rank per step, per replica when pipelined (default 32)")
    g.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for the split, the initialisation and the shards (default 0)")
    g.add_argument("--hidden", default="128,64", metavar="H1,H2,...",
                   help="hidden layer sizes (default 128,64)")
    g.add_argument("--topk-ratio", type=float, default=0.01, metavar="R",
                   help="fraction of each gradient topk sends (default 0.01)")
    g.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB",
                   help="all-reduce bucket size in MiB (default 25)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="bound on every collective (default: the transport's timeout)")
    d = parser.add_argument_group("periodic synchronisation (--aggregator diloco | local-sgd)")
    d.add_argument("--sync-every", type=int, default=50, metavar="H",
                   help="inner steps between synchronisations (default 50)")
    d.add_argument("--quantize", default=None, metavar="Q",
                   help="exchange in int8 or int4 (also int8:absmax, int4:minmax:256; "
                        "default: float32)")
    d.add_argument("--fragments", type=int, default=1, metavar="F",
                   help="streaming: fragments synchronised at staggered steps (default 1)")
    d.add_argument("--fragment-sync-delay", type=int, default=0, metavar="D",
                   help="streaming: steps a fragment's exchange runs behind (default 0)")
    d.add_argument("--fragment-mixing", type=float, default=0.0, metavar="A",
                   help="streaming: weight of the local fragment when the global one "
                        "lands (default 0)")
    d.add_argument("--outer-lr", type=float, default=0.7, help="diloco outer lr (default 0.7)")
    d.add_argument("--outer-momentum", type=float, default=0.9,
                   help="diloco outer Nesterov momentum (default 0.9)")
    p = parser.add_argument_group("pipeline parallelism")
    p.add_argument("--pipeline-stages", type=int, default=0, metavar="P",
                   help="split the MLP into P pipeline stages, one per rank; the world size "
                        "must be a multiple of P (default 0: no pipelining). Only with "
                        "--aggregator ring, no checkpointing")
    p.add_argument("--micro-batches", type=int, default=4, metavar="M",
                   help="micro-batches per replica batch (default 4)")
    schedules = [kind.value for kind in ScheduleKind]
    p.add_argument("--schedule", choices=schedules, default=ScheduleKind.ONE_F_ONE_B.value,
                   help=f"pipeline schedule (default {ScheduleKind.ONE_F_ONE_B.value})")
    p.add_argument("--pipeline-balance", choices=("params", "layers"), default="params",
                   help="cut stages with equal parameter counts or equal layer counts "
                        "(default params)")
    c = parser.add_argument_group("checkpointing")
    c.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="directory for distributed checkpoints")
    c.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (default: only at the end)")
    c.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Build the ``DemoConfig`` the training flags describe (``ConfigError`` if invalid)."""
    from netdist.errors import ConfigError
    from netdist.train.digits_job import DemoConfig

    try:
        hidden = tuple(int(h) for h in str(args.hidden).split(",") if h.strip())
    except ValueError as exc:
        raise ConfigError(f"--hidden must be comma-separated integers, got {args.hidden!r}") from exc
    return DemoConfig(
        aggregator=args.aggregator, epochs=args.epochs, batch_size=args.batch_size,
        lr=args.lr, momentum=args.momentum, seed=args.seed, hidden=hidden,
        topk_ratio=args.topk_ratio, bucket_mb=args.bucket_mb, timeout=args.timeout,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, pipeline_stages=args.pipeline_stages,
        micro_batches=args.micro_batches, schedule=args.schedule,
        pipeline_balance=args.pipeline_balance, sync_every=args.sync_every,
        quantize=args.quantize, fragments=args.fragments,
        fragment_sync_delay=args.fragment_sync_delay, fragment_mixing=args.fragment_mixing,
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
    )


def training_argv(args: argparse.Namespace) -> list[str]:
    """The training flags of ``args`` as command-line arguments for ``netdist worker``."""
    argv = [
        "--aggregator", args.aggregator, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--lr", repr(args.lr),
        "--momentum", repr(args.momentum), "--seed", str(args.seed),
        "--hidden", str(args.hidden), "--topk-ratio", repr(args.topk_ratio),
        "--bucket-mb", repr(args.bucket_mb),
    ]
    if args.aggregator in ("diloco", "local-sgd"):
        argv += ["--sync-every", str(args.sync_every), "--fragments", str(args.fragments),
                 "--fragment-sync-delay", str(args.fragment_sync_delay),
                 "--fragment-mixing", repr(args.fragment_mixing),
                 "--outer-lr", repr(args.outer_lr), "--outer-momentum", repr(args.outer_momentum)]
        if args.quantize:
            argv += ["--quantize", args.quantize]
    if args.timeout is not None:
        argv += ["--timeout", repr(args.timeout)]
    if args.checkpoint_dir is not None:
        argv += ["--checkpoint-dir", args.checkpoint_dir]
    if args.checkpoint_every:
        argv += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.resume:
        argv.append("--resume")
    if args.pipeline_stages:
        argv += ["--pipeline-stages", str(args.pipeline_stages),
                 "--micro-batches", str(args.micro_batches), "--schedule", args.schedule,
                 "--pipeline-balance", args.pipeline_balance]
    return argv


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``worker`` subcommand."""
    parser = subparsers.add_parser(
        "worker",
        help="run one rank of the digits training job",
        description="Run one rank of the digits MLP job (data-parallel, or pipelined with "
                    "--pipeline-stages). Rank, world size and coordinator come from the "
                    "environment (see netdist launch).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_training_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Join the job from the environment and train; rank 0 prints progress."""
    from netdist.cli.loop import run as run_loop
    from netdist.config import validate_environment

    config = config_from_args(args)
    validate_environment()  # every NETDIST_* setting now, not when first used mid-job

    async def main() -> int:
        from netdist.train.digits_job import train_worker
        from netdist.transport.bootstrap import init

        async with init() as transport:
            await train_worker(transport, config, log=lambda line: print(line, flush=True))
        return 0

    return run_loop(main())
