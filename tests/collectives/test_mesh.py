"""``DeviceMesh`` over real TCP: coordinates, groups along every dimension and sub-mesh,
collectives running along two dimensions at once, agreement checks and clear errors."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from netdist.collectives import DeviceMesh, Group
from netdist.errors import CollectiveMismatchError
from netdist.sharding import MeshPosition, mesh_coordinate, mesh_rank
from netdist.transport.local_tcp import local_tcp_group

pytestmark = pytest.mark.timeout(120)


async def _meshes(transports, shape, names=None) -> list[DeviceMesh]:
    groups = [Group(t) for t in transports]
    return list(await asyncio.wait_for(
        asyncio.gather(*(g.new_mesh(shape, names) for g in groups)), 30))


def test_row_major_coordinates() -> None:
    shape = (2, 3, 2)
    for rank in range(12):
        assert mesh_rank(shape, mesh_coordinate(shape, rank)) == rank
    assert mesh_coordinate(shape, 7) == (1, 0, 1)
    with pytest.raises(ValueError, match="not on a mesh"):
        mesh_coordinate(shape, 12)


async def test_groups_along_every_dimension_are_lines_of_the_grid() -> None:
    async with local_tcp_group(8, timeout=20.0) as transports:
        meshes = await _meshes(transports, {"pp": 2, "dp": 2, "tp": 2})
        for rank, mesh in enumerate(meshes):
            assert mesh.coordinate == mesh_coordinate((2, 2, 2), rank)
            assert mesh.rank == rank
            assert mesh.position == MeshPosition((2, 2, 2), ("pp", "dp", "tp"),
                                                 mesh.coordinate)
            pp, dp, tp = mesh.coordinate
            assert mesh.group("tp").ranks == (4 * pp + 2 * dp, 4 * pp + 2 * dp + 1)
            assert mesh.group("dp").ranks == (4 * pp + tp, 4 * pp + 2 + tp)
            assert mesh.group("pp").ranks == (2 * dp + tp, 4 + 2 * dp + tp)
            assert mesh.group(("dp", "tp")).ranks == tuple(range(4 * pp, 4 * pp + 4))
            assert mesh.group("tp").rank == tp and mesh.local_rank("dp") == dp
            assert mesh.group("tp") is mesh.group(2) is mesh["tp"].group("tp")
            # one row of the mesh: every member sees the same group id
        for dims in ("pp", "dp", "tp", ("dp", "tp"), ("pp", "tp")):
            by_ranks: dict[tuple[int, ...], set[int]] = {}
            for mesh in meshes:
                g = mesh.group(dims)
                by_ranks.setdefault(g.ranks, set()).add(g.group_id)
            assert all(len(ids) == 1 for ids in by_ranks.values()), dims
            ids = [next(iter(v)) for v in by_ranks.values()]
            assert len(set(ids)) == len(ids)  # lines along a dim never share an id


async def test_collectives_along_two_dimensions_at_once() -> None:
    async with local_tcp_group(4, timeout=20.0) as transports:
        meshes = await _meshes(transports, (2, 2), ("dp", "tp"))

        async def run(mesh: DeviceMesh) -> tuple[np.ndarray, np.ndarray]:
            x = np.full(1000, float(10 ** mesh.rank))
            y = x.copy()
            # both in flight at once: tags of different groups never meet
            tp_work = await mesh.group("tp").all_reduce(x, async_op=True)
            dp_work = await mesh.group("dp").all_reduce(y, async_op=True)
            await tp_work
            await dp_work
            return x, y

        results = await asyncio.wait_for(asyncio.gather(*(run(m) for m in meshes)), 60)
        for mesh, (x, y) in zip(meshes, results):
            dp, tp = mesh.coordinate
            assert np.all(x == sum(10.0 ** (2 * dp + t) for t in range(2)))
            assert np.all(y == sum(10.0 ** (2 * d + tp) for d in range(2)))
        await asyncio.gather(*(m.aclose() for m in meshes))


async def test_submesh_keeps_the_given_dimension_order() -> None:
    async with local_tcp_group(6, timeout=20.0) as transports:
        meshes = await _meshes(transports, {"dp": 3, "tp": 2})
        for mesh in meshes:
            sub = mesh.submesh(("tp", "dp"))
            assert sub.shape == (2, 3) and sub.names == ("tp", "dp")
            assert sub.coordinate == tuple(reversed(mesh.coordinate))
            # members in row-major order over (tp, dp)
            dp, tp = mesh.coordinate
            assert sub.ranks_along(("tp", "dp")) == tuple(
                2 * d + t for t, d in itertools.product(range(2), range(3)))
            assert sub.group("dp") is mesh.group("dp")
            line = mesh["dp"]
            assert line.shape == (3,) and line.coordinate == (dp,) and line.rank == dp


async def test_two_meshes_on_one_group_do_not_share_groups() -> None:
    async with local_tcp_group(2, timeout=20.0) as transports:
        groups = [Group(t) for t in transports]
        first = await asyncio.gather(*(g.new_mesh({"tp": 2}) for g in groups))
        second = await asyncio.gather(*(g.new_mesh({"tp": 2}) for g in groups))
        assert first[0].group("tp").group_id != second[0].group("tp").group_id
        assert first[0].group("tp").group_id == first[1].group("tp").group_id
        out = await asyncio.gather(*(m.group("tp").all_gather(np.array([m.rank]))
                                     for m in second))
        assert [o.tolist() for o in out] == [[0, 1], [0, 1]]


async def test_shapes_that_do_not_fit_are_refused_before_any_traffic() -> None:
    async with local_tcp_group(4, timeout=20.0) as transports:
        group = Group(transports[0])
        with pytest.raises(ValueError, match=r"dp=3 x tp=2 holds 6 ranks, but the group has 4"):
            await group.new_mesh({"dp": 3, "tp": 2})
        with pytest.raises(ValueError, match="distinct"):
            await group.new_mesh((2, 2), ("tp", "tp"))
        with pytest.raises(ValueError, match="2 names"):
            await group.new_mesh((4,), ("dp", "tp"))
        with pytest.raises(ValueError, match="ints >= 1"):
            await group.new_mesh({"dp": 0, "tp": 4})


async def test_ranks_that_ask_for_different_meshes_all_fail() -> None:
    async with local_tcp_group(4, timeout=20.0) as transports:
        groups = [Group(t) for t in transports]
        asked = [{"dp": 2, "tp": 2}] * 3 + [{"tp": 2, "dp": 2}]
        results = await asyncio.wait_for(asyncio.gather(
            *(g.new_mesh(a) for g, a in zip(groups, asked)), return_exceptions=True), 30)
        assert all(isinstance(r, CollectiveMismatchError) for r in results), results
        assert "rank 3: tp=2 x dp=2" in str(results[0])
        assert "rank 0: dp=2 x tp=2" in str(results[3])


async def test_unknown_dimension_is_named() -> None:
    async with local_tcp_group(2, timeout=20.0) as transports:
        meshes = await _meshes(transports, {"dp": 1, "tp": 2})
        with pytest.raises(KeyError, match="no dimension 'pp'.*dp, tp"):
            meshes[0].group("pp")
        with pytest.raises(ValueError, match="distinct"):
            meshes[0].group(("tp", "tp"))
