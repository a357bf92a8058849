"""``netdist.ray.places`` (PURE): a Ray Train worker's place and its job's ticket become
the environment netdist reads back as that rank of that job. No Ray needed."""

from __future__ import annotations

import pytest

from netdist.config import DistributedConfig
from netdist.errors import ConfigError
from netdist.ray.places import JobTicket, WorkerPlace, check_places, worker_environment

TOKEN = "f" * 64
TICKET = JobTicket(coordinator=("10.0.0.5", 41000), store=("10.0.0.5", 41001),
                   job_id="ray-train-0a1b2c3d", token=TOKEN)


def _place(rank: int = 2, *, local_rank: int = 0, node_ip: str = "10.0.0.7") -> WorkerPlace:
    return WorkerPlace(rank=rank, world_size=4, local_rank=local_rank, local_world_size=2,
                       node_rank=1, node_ip=node_ip)


def test_the_environment_is_netdist_launchs_for_that_rank() -> None:
    env = worker_environment(_place(), TICKET, {})
    assert env == {
        "NETDIST_RANK": "2", "NETDIST_WORLD_SIZE": "4",
        "NETDIST_COORDINATOR": "10.0.0.5:41000", "NETDIST_TOKEN": TOKEN,
        "NETDIST_JOB_ID": "ray-train-0a1b2c3d",
        "NETDIST_ADVERTISE_ADDR": "10.0.0.7", "NETDIST_HOST_ID": "10.0.0.7",
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41001"}


def test_netdist_reads_the_environment_back_as_that_rank_of_that_job() -> None:
    config = DistributedConfig.from_env(worker_environment(_place(), TICKET, {}))
    assert (config.rank, config.world_size) == (2, 4)
    assert config.coordinator == ("10.0.0.5", 41000)  # NETDIST_COORDINATOR, not MASTER_*
    assert (config.token, config.job_id) == (TOKEN, "ray-train-0a1b2c3d")
    assert config.advertise_addr == "10.0.0.7"


def test_a_workers_own_advertise_address_and_host_id_are_kept() -> None:
    current = {"NETDIST_ADVERTISE_ADDR": "192.168.1.9", "NETDIST_HOST_ID": "rack3-a"}
    env = worker_environment(_place(), TICKET, current)
    assert "NETDIST_ADVERTISE_ADDR" not in env and "NETDIST_HOST_ID" not in env
    # empty means unset, as everywhere in netdist's configuration
    env = worker_environment(_place(), TICKET, {"NETDIST_HOST_ID": ""})
    assert env["NETDIST_HOST_ID"] == "10.0.0.7"


def test_an_ipv6_coordinator_is_written_in_brackets() -> None:
    ticket = JobTicket(coordinator=("fd00::5", 41000), store=("fd00::5", 41001),
                       job_id="j", token=TOKEN)
    env = worker_environment(_place(node_ip="fd00::7"), ticket, {})
    assert env["NETDIST_COORDINATOR"] == "[fd00::5]:41000"
    assert DistributedConfig.from_env(env).coordinator == ("fd00::5", 41000)
    assert env["MASTER_ADDR"] == "fd00::5"  # torch's env:// takes the bare address


def test_the_ticket_never_shows_its_token() -> None:
    assert TOKEN not in repr(TICKET) and TOKEN not in str(TICKET)
    assert "token='***'" in repr(TICKET)


@pytest.mark.parametrize(("changes", "message"), [
    ({"store": ("10.0.0.5", 41000)}, "same address 10.0.0.5:41000"),
    ({"token": ""}, "needs a token"),
])
def test_a_bad_ticket_is_refused(changes: dict[str, object], message: str) -> None:
    fields = {"coordinator": ("10.0.0.5", 41000), "store": ("10.0.0.5", 41001),
              "job_id": "j", "token": TOKEN, **changes}
    with pytest.raises(ConfigError, match=message):
        JobTicket(**fields)  # type: ignore[arg-type]


def test_a_place_outside_its_world_is_refused() -> None:
    with pytest.raises(ConfigError, match="rank 4 in a world of 4"):
        _place(rank=4)
    with pytest.raises(ConfigError, match="local rank 2 of 2"):
        _place(local_rank=2)


def test_check_places_names_the_first_worker_out_of_order() -> None:
    places = [_place(rank) for rank in range(4)]
    check_places(places)
    with pytest.raises(ConfigError, match="worker 1 of 4 reports rank 2 of 4 .node 10.0.0.7"):
        check_places([places[0], places[2], places[1], places[3]])
    with pytest.raises(ConfigError, match="worker 0 of 3 reports rank 0 of 4"):
        check_places(places[:3])
