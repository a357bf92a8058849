"""``netdist ps-server``: run the dedicated parameter-server ranks of a job.

The first ``--num-servers`` ranks of the job (default ``$NETDIST_PS_SERVERS``, else 2, or
1 in a 2-rank job: ``netdist.ps.roles.default_num_servers``) serve: each joins the job
(``netdist.init``: rank, world size, coordinator and token from the environment), holds
its shard of the parameters, applies the optimizer the workers chose, and exits 0 once
every worker has said it is done. The other ranks are workers:
given a command after ``--`` they replace themselves with it (``exec``), with
``NETDIST_PS_SERVERS`` set, so one command line starts the whole job::

    netdist launch -n 5 -- netdist ps-server --num-servers 2 -- python train.py

Here ranks 0 and 1 serve and ranks 2..4 run ``train.py``, which uses
``netdist.ps.PSClient(transport, num_servers=2)``. A failed or lost worker makes the
servers exit 1 with the reason (and tells the other workers). ``--help`` shows the same
as plain text (``_DESCRIPTION``): argparse prints a description verbatim.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from netdist.errors import ConfigError

if TYPE_CHECKING:
    from netdist.config import DistributedConfig
    from netdist.ps.server import ServerReport

__all__ = ["add_parser", "run", "main"]

_DESCRIPTION = """\
Run the dedicated parameter-server ranks of a job. The first S ranks (--num-servers S)
serve: each joins the job (rank, world size, coordinator and token from the
environment), holds its shard of the parameters, applies the optimizer the workers
chose, and exits 0 once every worker has said it is done. The other ranks are workers:
given a command after '--' they replace themselves with it (exec), with
NETDIST_PS_SERVERS=S set, so one command line starts the whole job. A failed or lost
worker makes the servers exit 1 with the reason (and tells the other workers), unless
the workers chose to go on without it (WorkerLoss.CONTINUE). With --replicas 1 every
server also keeps a backup of the previous server's shard and takes it over if that
server is lost; the workers fail over to it (set NETDIST_PS_REPLICAS for them too: the
servers export it to the worker command).
"""

_EPILOG = """\
NETDIST_PS_SERVERS=S   server ranks when --num-servers is not given
                       (default 2, or fewer in a job too small to keep a worker:
                       1 in a 2-rank job)
NETDIST_PS_REPLICAS=R  backups per shard when --replicas is not given (0 or 1;
                       default 0)
NETDIST_TIMEOUT=SEC    the default --timeout

examples:
  netdist launch -n 5 -- netdist ps-server --num-servers 2 -- python train.py
      ranks 0-1 serve, ranks 2-4 exec "python train.py"
  NETDIST_RANK=0 NETDIST_WORLD_SIZE=3 NETDIST_COORDINATOR=10.0.0.1:29400 \\
  NETDIST_TOKEN=secret NETDIST_PS_SERVERS=1 netdist ps-server
      one server rank of a job whose workers are started separately
"""


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-servers", type=int, default=None, metavar="S",
                        help="how many leading ranks serve (default: $NETDIST_PS_SERVERS, "
                             "else 2, or 1 in a 2-rank job)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="bound on every wait, including a worker's silence between "
                             "requests (default: the transport's timeout, $NETDIST_TIMEOUT)")
    parser.add_argument("--replicas", type=int, default=None, metavar="R",
                        help="backups per server shard, 0 or 1 (default: "
                             "$NETDIST_PS_REPLICAS, else 0); needs 2 or more servers")
    parser.add_argument("worker_cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                        help="command the worker ranks exec")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``ps-server``."""
    parser = subparsers.add_parser(
        "ps-server", help="run the dedicated parameter-server ranks of a job",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(parser)


def _worker_command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.worker_cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return cmd


def run(args: argparse.Namespace) -> int:
    """Serve on server ranks; exec the worker command on worker ranks."""
    from netdist.config import DistributedConfig
    from netdist.ps.faults import PS_REPLICAS_ENV, ReplicaLayout, replicas_from_env
    from netdist.ps.roles import PS_SERVERS_ENV, num_servers_from_env, ps_roles

    config = DistributedConfig.from_env()
    num_servers = (args.num_servers if args.num_servers is not None
                   else num_servers_from_env(world_size=config.world_size))
    roles = ps_roles(config.world_size, num_servers)
    replicas = args.replicas if args.replicas is not None else replicas_from_env()
    ReplicaLayout(num_servers, replicas)  # ConfigError for an impossible layout
    if args.timeout is not None:
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ConfigError(f"--timeout must be a finite number of seconds > 0, got "
                              f"{args.timeout}")
        config = config.replace(timeout=args.timeout)
    if not roles.is_server(config.rank):
        cmd = _worker_command(args)
        if not cmd:
            raise ConfigError(
                f"rank {config.rank} is a worker rank (servers are ranks 0..{num_servers - 1}); "
                "give the worker command after '--', or start workers separately")
        os.environ[PS_SERVERS_ENV] = str(num_servers)
        os.environ[PS_REPLICAS_ENV] = str(replicas)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            raise ConfigError(f"cannot run worker command {cmd[0]!r}: {exc}") from None
    from netdist.cli.loop import run as run_loop

    report = run_loop(_serve(config, num_servers, replicas))
    print(f"parameter server {report.server}: {report.num_workers} workers done, "
          f"{report.version} updates, max staleness {report.max_staleness_observed}",
          flush=True)
    if report.dropped:
        print(f"parameter server {report.server}: went on without worker ranks "
              f"{list(report.dropped)}", flush=True)
    if report.takeover is not None:
        print(f"parameter server {config.rank}: took over shard {report.takeover.server} "
              f"from its lost primary; {report.takeover.version} updates", flush=True)
    return 0


async def _serve(config: DistributedConfig, num_servers: int, replicas: int) -> ServerReport:
    from netdist.ps.server import PSServer
    from netdist.transport.bootstrap import init

    async with init(config) as transport:
        return await PSServer(transport, num_servers=num_servers, replicas=replicas).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m netdist.cli.ps_server``: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="netdist ps-server", description=_DESCRIPTION,
                                     epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(parser)
    args = parser.parse_args(argv)
    from netdist.cli.main import format_error
    from netdist.errors import NetdistError

    try:
        return run(args)
    except NetdistError as exc:
        print(format_error("ps-server", exc), file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
