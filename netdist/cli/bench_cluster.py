"""``netdist bench OP --layout 2x2 [--rate-mbit 1000]``: the bench's ranks on test hosts.

Instead of local processes on loopback, the ranks run in a ``netdist.netlab`` cluster:
one network namespace per host on a switch, every host's link shaped to ``--rate-mbit``
both ways (unshaped without it), the ranks of a host sharing it as they would a machine.
Each rank runs the same worker as ``netdist bench -n N`` (``python -m netdist.cli.bench
... --worker``) with the environment ``Cluster.rank_env`` gives it; rank 0's output is
this command's, the others' is shown only when they fail. Needs root (network namespaces
and ``tc``): ``ConfigError`` says what is missing otherwise.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

__all__ = ["run_in_cluster"]

_TAIL = 2000
"""Characters of a failed rank's stderr shown."""


def run_in_cluster(args: argparse.Namespace, worker_argv: list[str]) -> int:
    """Run the bench worker ``worker_argv`` on every rank of ``args.layout``; the exit
    status (0 when every rank succeeded)."""
    from netdist.errors import ConfigError
    from netdist.netlab.layout import ClusterLayout

    try:
        layout = ClusterLayout.parse(args.layout)
    except ValueError as exc:
        raise ConfigError(f"--layout: {exc}") from None
    if args.worker or os.environ.get("NETDIST_RANK"):
        raise ConfigError("--layout starts its own ranks: do not run it under a launcher")
    if args.nprocs is not None and args.nprocs != layout.world_size:
        raise ConfigError(f"-n {args.nprocs} disagrees with --layout {layout} "
                          f"({layout.world_size} ranks); leave -n out")
    if args.op == "p2p" and layout.world_size < 2:
        raise ConfigError(f"bench p2p needs at least 2 ranks, --layout {layout} has 1")
    if args.rate_mbit is not None and args.rate_mbit <= 0:
        raise ConfigError(f"--rate-mbit must be positive, got {args.rate_mbit:g}")
    if args.job_timeout <= 0:
        raise ConfigError(f"--job-timeout must be positive, got {args.job_timeout:g}")
    from netdist.netlab import lab

    missing = lab.netlab_missing()
    if missing is not None:
        raise ConfigError(f"--layout runs the ranks in network namespaces: {missing}")
    from netdist.netlab.cluster import Cluster

    rate = "unshaped links" if args.rate_mbit is None else f"{args.rate_mbit:g} Mbit/s links"
    print(f"# cluster {layout}: {layout.hosts} hosts ({layout.world_size} ranks) on one "
          f"switch, {rate} (full duplex, network namespaces)", flush=True)
    command = [sys.executable, "-m", "netdist.cli.bench", *worker_argv]
    with Cluster.create(layout, rate_mbit=args.rate_mbit) as cluster:
        results = cluster.run(lambda rank: command, args.job_timeout,
                              token=secrets.token_hex(16), passthrough=(0,))
    failed = [r for r in results if not r.ok]
    why_killed = ("another rank failed" if any(not r.killed for r in failed)
                  else f"still running after --job-timeout {args.job_timeout:g} s")
    for r in failed:
        how = f"was killed: {why_killed}" if r.killed else f"exited with {r.returncode}"
        print(f"netdist bench: rank {r.rank} on host {layout.host_of(r.rank)} {how}"
              + (f"; its stderr ends:\n{r.stderr[-_TAIL:]}" if r.stderr.strip() else ""),
              file=sys.stderr, flush=True)
    if not failed:
        return 0
    exited = [r.returncode for r in failed if not r.killed and r.returncode > 0]
    return exited[0] if exited else 1
