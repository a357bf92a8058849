"""Hosts with their own network stacks, for tests and benchmarks: network namespaces.

``NetLab`` (``netdist.netlab.lab``) makes namespaces ("hosts") joined by shaped or lossy
links; ``Cluster`` (``netdist.netlab.cluster``) puts H hosts of R ranks each on one
switch, every host with a full-duplex link of a given rate, and starts one process per
rank in its host; ``ClusterLayout`` (``netdist.netlab.layout``, PURE) says how many ranks
run on each host (``"2x4"``, ``"1,2,3"``).

Needs Linux and root, ``ip`` and ``tc`` (iproute2) and, for lossy links,
``/dev/net/tun``: ``netlab_missing()`` says what is absent. A lab only touches the
namespaces it creates (and the devices in them): the machine's own interfaces, routes
and firewall are never changed, and everything it made is deleted when it closes.
``netdist bench --layout``, ``benchmarks/multihost.py`` and the tests use it; library
code never does.

Names resolve lazily (``netdist._lazy``), like every netdist package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "NetLab": "netdist.netlab.lab",
    "Host": "netdist.netlab.lab",
    "Link": "netdist.netlab.lab",
    "netlab_missing": "netdist.netlab.lab",
    "rank_env": "netdist.netlab.lab",
    "burst_bytes": "netdist.netlab.lab",
    "ClusterLayout": "netdist.netlab.layout",
    "Cluster": "netdist.netlab.cluster",
    "RankResult": "netdist.netlab.processes",
}

__all__ = ["NetLab", "Host", "Link", "netlab_missing", "rank_env", "burst_bytes",
           "ClusterLayout", "Cluster", "RankResult"]

if TYPE_CHECKING:
    from netdist.netlab.cluster import Cluster
    from netdist.netlab.lab import Host, Link, NetLab, burst_bytes, netlab_missing, rank_env
    from netdist.netlab.layout import ClusterLayout
    from netdist.netlab.processes import RankResult
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
