"""``netdist launch -n N [options] -- CMD ARGS...``: run N local ranks of a job."""

from __future__ import annotations

import argparse

from netdist.errors import ConfigError
from netdist.launcher import DEFAULT_GRACE_PERIOD, launch

__all__ = ["add_parser", "run"]

_EPILOG = """\
each rank gets NETDIST_RANK, NETDIST_WORLD_SIZE, NETDIST_COORDINATOR, NETDIST_JOB_ID,
NETDIST_TOKEN (kept from the environment or generated; never printed),
NETDIST_RESTART_COUNT, RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, and
MASTER_ADDR / MASTER_PORT for torch.distributed (a port that is not the coordinator's).

when a rank fails the others are stopped, and a summary at the end names the rank that
went away first (failed, exited 0 while others still ran, or was stopped) with its own
error, then every other rank in one line. On Linux the ranks die with the launcher.

every NETDIST_* variable the ranks will read (NETDIST_TIMEOUT, NETDIST_SHM, ...) is
checked before any rank starts: a bad value stops the launcher with one line.

exit status: 0 if every rank succeeded; else the first failing rank's exit code
(128+N if it died from signal N); 130/143 on SIGINT/SIGTERM; 124 on --timeout;
127/126 if the command cannot be started; 2 for invalid options or NETDIST_* values.

elastic mode (--elastic): a slot that fails is restarted alone while the others keep
running; --max-restarts K then counts per slot. --spares S starts S extra slots at once.
The job fails once fewer than --min-nodes slots (default: a strict majority of N) are
running, restartable or done, and succeeds when every slot that is not down exited 0.
Each process also gets NETDIST_ELASTIC=1, NETDIST_ELASTIC_SLOT, NETDIST_ELASTIC_PORT (its
own port on NETDIST_ELASTIC_HOST, default 127.0.0.1, kept across its restarts),
NETDIST_ELASTIC_SEEDS (every slot's host:port), NETDIST_ELASTIC_MIN and its own
NETDIST_RESTART_COUNT; spares get no NETDIST_RANK / RANK / LOCAL_RANK. Output is
prefixed [slot N].

examples:
  netdist launch -n 4 -- python train.py --epochs 3
  netdist launch --elastic -n 4 --spares 1 --max-restarts 3 -- python train.py
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``launch`` subcommand."""
    parser = subparsers.add_parser(
        "launch",
        help="start N local ranks of a job",
        description="Start N local processes as the ranks of one job, prefix their output\n"
                    "with the rank, and stop them all when one fails.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, metavar="N",
                        help="number of ranks to start")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="rank 0's coordinator address (default: a free port on "
                             "127.0.0.1, new on each restart; with --elastic, one for the "
                             "whole run)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the whole job up to K times after a rank fails "
                             "(NETDIST_RESTART_COUNT tells the job; default 0); with "
                             "--elastic, restart each failed slot alone, up to K times "
                             "per slot")
    parser.add_argument("--elastic", action="store_true",
                        help="elastic job: restart only the process that failed, keep the "
                             "others running (see below)")
    parser.add_argument("--spares", type=int, default=0, metavar="S",
                        help="with --elastic: start S spare processes that join the job "
                             "(slots N..N+S-1; default 0)")
    parser.add_argument("--min-nodes", type=int, default=None, metavar="M",
                        help="with --elastic: fail the job once fewer than M slots are "
                             "running or restartable (default: a strict majority of N)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="wall-clock limit for the whole job, restarts included")
    parser.add_argument("--job-id", default=None, metavar="ID",
                        help="job id shared by all ranks (default: NETDIST_JOB_ID or random)")
    parser.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                        metavar="SECONDS",
                        help="time between SIGTERM and SIGKILL when stopping ranks "
                             f"(default {DEFAULT_GRACE_PERIOD:g})")
    parser.add_argument("--no-prefix", dest="prefix_output", action="store_false",
                        help="let ranks write straight to the terminal, without [rank N]")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                        help="the program every rank runs")


def run(args: argparse.Namespace) -> int:
    """Launch the job described by ``args``; return its exit status."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ConfigError("no command given (usage: netdist launch -n N -- CMD [ARGS...])")
    return launch(
        command,
        args.nprocs,
        coordinator=args.coordinator,
        max_restarts=args.max_restarts,
        prefix_output=args.prefix_output,
        timeout=args.timeout,
        job_id=args.job_id,
        grace_period=args.grace_period,
        elastic=args.elastic,
        spares=args.spares,
        min_nodes=args.min_nodes,
    )
