"""Ray Train's backend for netdist's own API: every worker of the group is a rank of one
netdist job, and ``netdist.connect()`` / ``netdist.init()`` in the train function join it.

``NetdistJobConfig`` goes to Ray Train's data-parallel trainer
(``ray.train.v2.api.data_parallel_trainer.DataParallelTrainer(...,
backend_config=NetdistJobConfig())``); torch is not needed. Each time Ray Train starts the
worker group (the first time, and again after a failure), ``NetdistJobBackend.on_start``
issues a new ``JobTicket`` (worker 0's node address, two ports free there, a new job id
and a random 256-bit token) and writes every worker's place into its environment
(``netdist.ray.places.worker_environment``). The token travels to the workers as an
argument of Ray's own calls, never through a store or a log.

``netdist.ray.NetdistConfig`` (for ``TorchTrainer``) does the same and then makes torch's
process group on netdist.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend, BackendConfig

from netdist.ray.places import JobTicket, WorkerPlace, check_places
from netdist.ray.worker_env import reserve_addresses, take_place

__all__ = ["NetdistJobConfig", "NetdistJobBackend", "issue_ticket"]

logger = logging.getLogger("netdist.ray")

TOKEN_BYTES = 32
"""Random bytes in each start's token (``secrets.token_hex``: 64 hex characters)."""


def issue_ticket(worker_group: Any) -> JobTicket:
    """A new ticket for one start of ``worker_group`` (Ray Train's worker group): worker
    0's node address with two ports free there, a new job id and a new token."""
    address, coordinator_port, store_port = worker_group.execute_single(0, reserve_addresses)
    return JobTicket(coordinator=(address, coordinator_port), store=(address, store_port),
                     job_id=f"ray-train-{secrets.token_hex(4)}",
                     token=secrets.token_hex(TOKEN_BYTES))


def start_job(worker_group: Any) -> tuple[JobTicket, list[WorkerPlace]]:
    """Issue a ticket and give every worker of ``worker_group`` its place in the ticket's
    job (its environment); the ticket and the places, checked (``check_places``)."""
    ticket = issue_ticket(worker_group)
    places: list[WorkerPlace] = worker_group.execute(take_place, ticket)
    check_places(places)
    nodes = sorted({place.node_ip for place in places})
    logger.info("netdist: Ray Train worker group of %d on %d node(s) joins job %s at %s:%d",
                len(places), len(nodes), ticket.job_id, *ticket.coordinator)
    return ticket, places


class NetdistJobBackend(Backend):
    """Ray Train's ``Backend`` for ``NetdistJobConfig``: gives every worker its place in a
    new netdist job at each start of the worker group. Joining is the train function's
    (``netdist.connect()``), and so is leaving (its ``with`` block), so there is nothing
    to close on shutdown (``Backend.on_shutdown`` does nothing)."""

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        start_job(worker_group)


@dataclass
class NetdistJobConfig(BackendConfig):
    """Ray Train configuration for a netdist job without torch: each worker's environment
    holds its rank, the world size, the coordinator (worker 0's node), the job id and a
    token drawn for this start of the group, so ``netdist.connect()`` (blocking) or
    ``netdist.init()`` (asyncio) in the train function joins the job as under
    ``netdist launch``. Other settings (``NETDIST_TIMEOUT``, heartbeats...) come from the
    workers' environment (Ray's ``runtime_env={"env_vars": ...}``)."""

    @property
    def backend_cls(self) -> type[NetdistJobBackend]:
        return NetdistJobBackend
