"""``netdist demo -n N [flags]``: train the digits MLP with N local ranks.

Starts N ``netdist worker`` processes on 127.0.0.1 through the launcher (output prefixed
``[rank N]``); rank 0 reports epoch, step, loss, samples/s, the share of time spent
communicating and the final test accuracy. With ``--pipeline-stages P`` the N ranks form
N/P replicas of a P-stage pipeline (N must be a multiple of P; checked here, before any
process starts), and so is --checkpoint-dir: created, and a probe file written and
removed, so a directory that cannot be written fails here in one line (exit 2) instead of
at the first save.
"""

from __future__ import annotations

import argparse
import sys

from netdist.cli.worker import add_training_flags, config_from_args, training_argv

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  netdist demo -n 4                          # ring all-reduce, 20 epochs
  netdist demo -n 4 --aggregator topk        # 1% of each gradient, error feedback
  netdist demo -n 2 --epochs 5 --seed 3
  netdist demo -n 2 --pipeline-stages 2      # the MLP cut into 2 pipeline stages
  netdist demo -n 4 --pipeline-stages 2 --micro-batches 8 --schedule gpipe
                                             # 2 stages x 2 data-parallel replicas

--pipeline-stages works with --aggregator ring only (each stage's gradients are
all-reduced over its replicas) and cannot be combined with checkpointing
(--checkpoint-dir, --checkpoint-every, --resume); both are refused with an error.
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="train an MLP on the digits data set with N local ranks",
        description="Launch N local ranks of the digits MLP job (data-parallel, or "
                    "pipelined with --pipeline-stages) and report progress from rank 0.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, default=4, metavar="N",
                        help="number of ranks (default 4)")
    parser.add_argument("--job-timeout", type=float, default=None, metavar="SECONDS",
                        help="wall-clock limit for the whole job")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the job up to K times after a failure "
                             "(use with --checkpoint-dir and --resume)")
    add_training_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then launch the workers; return the job's exit status."""
    from netdist.errors import ConfigError
    from netdist.launcher import launch

    if args.nprocs < 1:
        raise ConfigError(f"-n must be >= 1, got {args.nprocs}")
    config = config_from_args(args)  # fail here, once, rather than in every rank
    config.check_world_size(args.nprocs)
    if config.checkpoint_dir:  # before any rank starts, not at the first save
        from netdist.train.digits_job import checkpoint_dir_problem

        problem = checkpoint_dir_problem(config.checkpoint_dir)
        if problem:
            raise ConfigError(f"--checkpoint-dir: {problem}")
    cmd = [sys.executable, "-m", "netdist.cli.main", "worker", *training_argv(args)]
    return launch(cmd, args.nprocs, max_restarts=args.max_restarts, timeout=args.job_timeout)
