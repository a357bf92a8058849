"""The two-level collectives across hosts, bit for bit, between real processes.

Hosts here are told apart by ``NETDIST_HOST_ID`` on 127.0.0.1 (the transport's host
keys, exactly what separate machines give): layouts 2x1, 2x2 and three hosts with 1, 2
and 3 ranks, through netdist's own API (single copy and staged) and through
``torch.distributed``; ``tests/multihost/two_level_worker.py`` checks every result
against the single-host one. The byte counts on each link are in
``test_two_level_traffic.py``; the same across network namespaces with shaped links in
``test_netns.py``.
"""

from __future__ import annotations

import pytest

from tests.ranks import finish_ranks, free_port, start_ranks

pytestmark = pytest.mark.slow

ELEMENTS = 100_003  # odd: uneven chunks, pieces and segments everywhere
TORCH_ELEMENTS = 600_000  # above torch's 1 MiB threshold in bfloat16, divisible by 2..6


def _run(layout: tuple[int, ...], *args: str, torch: bool = False,
         elements: int = ELEMENTS) -> list[str]:
    hosts = [h for h, count in enumerate(layout) for _ in range(count)]
    world = len(hosts)
    port = free_port()

    def env(rank: int) -> dict[str, str]:
        extra = {"NETDIST_HOST_ID": f"host{hosts[rank]}"}
        if torch:
            extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                         WORLD_SIZE=str(world))
        return extra

    procs = start_ranks(world, "tests.multihost.two_level_worker",
                        [str(elements), *args, *(["--torch"] if torch else [])],
                        timeout=60, job_prefix="twolevel", env=env)
    outputs = []
    for rank, result in enumerate(finish_ranks(procs, timeout=300)):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout}"
        assert f"OK rank {rank}" in result.stdout, result.stdout
        outputs.append(result.stdout)
    return outputs


@pytest.mark.parametrize("layout, mode", [
    ((1, 1), "MODE tcp None"),
    ((2, 2), "MODE hierarchical single"),
    ((1, 2, 3), "MODE uneven hosts single"),
], ids=["2x1", "2x2", "3x(1,2,3)"])
def test_every_collective_is_bitwise_the_single_host_result(layout: tuple[int, ...],
                                                           mode: str) -> None:
    for out in _run(layout):
        assert mode in out, out


def test_staged_copies_across_hosts_give_the_same_bits() -> None:
    for out in _run((2, 2), "--staged"):
        assert "MODE hierarchical staged" in out, out


@pytest.mark.parametrize("layout", [(2, 2), (1, 2, 3)], ids=["2x2", "3x(1,2,3)"])
def test_torch_backend_across_hosts_is_bitwise_the_single_host_result(
        layout: tuple[int, ...]) -> None:
    pytest.importorskip("torch")
    _run(layout, torch=True, elements=TORCH_ELEMENTS)
