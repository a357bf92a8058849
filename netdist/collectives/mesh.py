"""``DeviceMesh``: the ranks of a group arranged in a grid of named dimensions.

A mesh of shape ``(2, 4)`` named ``("dp", "tp")`` over an 8-rank group puts group rank
``r`` at coordinate ``divmod(r, 4)``: row-major, the last dimension varies fastest, as in
``torch.distributed.init_device_mesh`` and Megatron (so the tensor-parallel ranks, the
chattiest, are neighbours, which on most launches means the same host). Each rank has a
``Group`` along every dimension (the ranks that differ from it in that coordinate only)
and along any set of dimensions (``mesh.group(("dp", "tp"))``, a flattened sub-mesh)::

    mesh = await DeviceMesh.create(world, {"dp": 2, "tp": 2})     # or world.new_mesh(...)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    await tp.all_reduce(partial_out)          # inside this rank's tensor-parallel pair
    await dp.all_reduce(grads, op=ReduceOp.MEAN)

Every group of a mesh is a subgroup of the group it was made from: it shares the
transport and, under the blocking API, the progress thread; its tags come from its own
group id, so collectives along different dimensions never meet even when they run at
the same time. ``create`` is collective (every member of ``group`` calls it, with the same
shape and names, in the same order relative to its other ``create``/``new_group`` calls)
and checks that the ranks agree. The groups are made on first use, from names that only
their members need to know (``Group.new_group(ranks, name=...)``), so a rank never builds
the groups it is not in.

``position`` gives the plain description a checkpoint records with each placed tensor
(``netdist.sharding.MeshPosition``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from netdist.errors import CollectiveMismatchError
from netdist.sharding import MeshPosition, mesh_coordinate, mesh_rank

if TYPE_CHECKING:
    from netdist.collectives.group import Group

__all__ = ["DeviceMesh", "MeshDims", "mesh_dims"]

MeshDims = Mapping[str, int] | Sequence[int]
"""A mesh's shape: ``{"dp": 2, "tp": 4}`` (names in order), or sizes with ``names=``."""

DimRef = str | int | Sequence[str | int]
"""One mesh dimension (its name or index) or several (a sequence of them)."""


def mesh_dims(shape: MeshDims, names: Sequence[str] | None = None
              ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(sizes, names)`` of a mesh given as a mapping or as sizes plus names.

    Sizes are ints >= 1 and names distinct non-empty strings, one per size; without
    names, sizes get ``dim0``, ``dim1``, ... ``ValueError`` / ``TypeError`` otherwise.
    """
    if isinstance(shape, Mapping):
        if names is not None:
            raise TypeError("give the mesh as a mapping of names to sizes or as sizes "
                            "with names=, not both")
        names, sizes = tuple(shape.keys()), tuple(shape.values())
    elif isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"a mesh shape is a mapping {{name: size}} or a sequence of "
                        f"sizes, got {type(shape).__name__}")
    else:
        sizes = tuple(shape)
        names = tuple(names) if names is not None else tuple(f"dim{i}" for i in
                                                             range(len(sizes)))
    if not sizes:
        raise ValueError("a mesh needs at least one dimension")
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh dimension sizes must be ints >= 1, got {list(sizes)}")
    if len(names) != len(sizes):
        raise ValueError(f"{len(names)} names {list(names)} for {len(sizes)} mesh "
                         f"dimensions {list(sizes)}")
    for name in names:
        if not isinstance(name, str) or not name or not name.isidentifier():
            raise ValueError(f"mesh dimension names must be identifiers, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh dimension names must be distinct, got {list(names)}")
    return tuple(int(s) for s in sizes), tuple(names)


def _describe(sizes: Sequence[int], names: Sequence[str]) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(names, sizes))


class DeviceMesh:
    """The ranks of ``group`` in a grid of named dimensions (module docstring).

    Build with :meth:`create` (collective). ``coordinate`` is this rank's place on the
    mesh, ``group(dim)`` its group along one dimension or several; ``submesh(dims)`` the
    mesh of the ranks that share this rank's coordinates on the other dimensions.
    """

    def __init__(self, group: Group, sizes: tuple[int, ...], names: tuple[str, ...],
                 key: str, *, root: DeviceMesh | None = None,
                 dims_in_root: tuple[int, ...] | None = None) -> None:
        """Internal: use :meth:`create` and :meth:`submesh`. ``key`` names the mesh among
        its parent's subgroups; a sub-mesh keeps its ``root`` mesh and which of the
        root's dimensions its own are (``dims_in_root``)."""
        self._parent = group
        self._sizes = sizes
        self._names = names
        self._key = key
        self._root = root if root is not None else self
        self._dims_in_root = dims_in_root if dims_in_root is not None else tuple(
            range(len(sizes)))
        if root is None:
            self._coordinate = mesh_coordinate(sizes, group.rank)
        else:
            self._coordinate = tuple(root._coordinate[i] for i in self._dims_in_root)
        self._groups: dict[tuple[int, ...], Group] = {}

    @classmethod
    async def create(cls, group: Group, shape: MeshDims, names: Sequence[str] | None = None,
                     *, timeout: float | None = None) -> DeviceMesh:
        """Arrange every rank of ``group`` on a mesh (collective: every member calls).

        ``shape`` is ``{"dp": 2, "tp": 4}`` or ``(2, 4)`` with ``names=("dp", "tp")``;
        the sizes must multiply to ``group.world_size`` (``ValueError`` naming both
        otherwise, raised before any communication). The ranks exchange what they asked
        for: if any rank asked for another mesh, every rank raises
        ``CollectiveMismatchError`` naming the ranks and their meshes.
        """
        sizes, dim_names = mesh_dims(shape, names)
        if math.prod(sizes) != group.world_size:
            raise ValueError(
                f"a mesh {_describe(sizes, dim_names)} holds {math.prod(sizes)} ranks, but "
                f"the group has {group.world_size}; the sizes must multiply to the "
                f"group's size")
        asked = {"sizes": list(sizes), "names": list(dim_names)}
        everyone = await group.all_gather_object(asked, timeout=timeout)
        differ = [r for r, other in enumerate(everyone) if other != asked]
        if differ:
            seen = "; ".join(f"rank {r}: {_describe(everyone[r]['sizes'], everyone[r]['names'])}"
                             for r in differ[:8])
            raise CollectiveMismatchError(
                f"DeviceMesh.create on group rank {group.rank}: this rank asked for "
                f"{_describe(sizes, dim_names)}, but {seen}")
        return cls(group, sizes, dim_names, f"mesh{group.next_child_index()}")

    # -- shape ---------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension."""
        return self._sizes

    @property
    def names(self) -> tuple[str, ...]:
        """Name of each dimension."""
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._sizes)

    @property
    def size(self) -> int:
        """Ranks on the mesh."""
        return math.prod(self._sizes)

    def dim_size(self, dim: str | int) -> int:
        """Size of one dimension, by name or index."""
        return self._sizes[self.dim_index(dim)]

    def dim_index(self, dim: str | int) -> int:
        """Index of a dimension given by name or index (``KeyError`` naming the mesh's
        dimensions for an unknown one)."""
        if isinstance(dim, str):
            if dim not in self._names:
                raise KeyError(f"mesh {self} has no dimension {dim!r} (it has "
                               f"{', '.join(self._names)})")
            return self._names.index(dim)
        if isinstance(dim, int) and not isinstance(dim, bool) and -self.ndim <= dim < self.ndim:
            return dim % self.ndim
        raise KeyError(f"mesh {self} has no dimension {dim!r}")

    def _dims(self, dims: DimRef) -> tuple[int, ...]:
        refs = (dims,) if isinstance(dims, (str, int)) else tuple(dims)
        indices = tuple(self.dim_index(d) for d in refs)
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"mesh {self}: dimensions {list(refs)} must be distinct and "
                             f"at least one")
        return indices

    # -- this rank ------------------------------------------------------------------------

    @property
    def parent(self) -> Group:
        """The group the mesh was made from."""
        return self._parent

    @property
    def rank(self) -> int:
        """This rank's place in row-major order (on the mesh made by ``create``, its rank
        in ``parent``)."""
        return mesh_rank(self._sizes, self._coordinate)

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's index along every dimension."""
        return self._coordinate

    def local_rank(self, dim: str | int) -> int:
        """This rank's index along one dimension (its rank in ``group(dim)``)."""
        return self._coordinate[self.dim_index(dim)]

    @property
    def position(self) -> MeshPosition:
        """Shape, names and this rank's coordinate as plain data (for checkpoints)."""
        return MeshPosition(self._sizes, self._names, self._coordinate)

    def describe(self) -> dict[str, Any]:
        """``{"shape": [...], "names": [...]}``: the mesh as a checkpoint records it."""
        return {"shape": list(self._sizes), "names": list(self._names)}

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """Coordinate of mesh rank ``rank``."""
        return mesh_coordinate(self._sizes, rank)

    def rank_of(self, coordinate: Sequence[int]) -> int:
        """Mesh rank at ``coordinate``."""
        coords = tuple(coordinate)
        if len(coords) != self.ndim or any(not 0 <= c < n for c, n in zip(coords,
                                                                           self._sizes)):
            raise ValueError(f"{coords} is not a coordinate on mesh {self}")
        return mesh_rank(self._sizes, coords)

    def ranks_along(self, dims: DimRef) -> tuple[int, ...]:
        """The parent-group ranks of this rank's line (plane, ...) along ``dims``: the
        ranks whose coordinates differ from this rank's only in ``dims``, in row-major
        order over those dimensions (the member order of ``group(dims)``)."""
        return self._root._ranks_along(self._in_root(dims))

    def _in_root(self, dims: DimRef) -> tuple[int, ...]:
        return tuple(self._dims_in_root[i] for i in self._dims(dims))

    def _ranks_along(self, indices: tuple[int, ...]) -> tuple[int, ...]:
        sub_sizes = [self._sizes[i] for i in indices]
        ranks = []
        for flat in range(math.prod(sub_sizes)):
            coords = list(self._coordinate)
            for i, c in zip(indices, mesh_coordinate(sub_sizes, flat)):
                coords[i] = c
            ranks.append(mesh_rank(self._sizes, coords))
        return tuple(ranks)

    # -- groups ---------------------------------------------------------------------------

    def group(self, dims: DimRef) -> Group:
        """This rank's group along one dimension (``"tp"``) or several (``("dp", "tp")``:
        the ranks varying in those, row-major). Made on first use, by this rank and the
        other members only; the same object afterwards (a sub-mesh hands out its root
        mesh's groups)."""
        return self._root._group(self._in_root(dims))

    def _group(self, indices: tuple[int, ...]) -> Group:
        found = self._groups.get(indices)
        if found is None:
            label = "+".join(self._names[i] for i in indices)
            found = self._parent.new_group(self._ranks_along(indices),
                                           name=f"{self._key}/{label}")
            self._groups[indices] = found
        return found

    def submesh(self, dims: DimRef) -> DeviceMesh:
        """The mesh of this rank's line along ``dims`` (other coordinates fixed), with
        those dimensions in the order given. Its groups are this mesh's groups."""
        indices = self._dims(dims)
        return DeviceMesh(self._parent, tuple(self._sizes[i] for i in indices),
                          tuple(self._names[i] for i in indices), self._key,
                          root=self._root,
                          dims_in_root=tuple(self._dims_in_root[i] for i in indices))

    def __getitem__(self, dims: DimRef) -> DeviceMesh:
        """``mesh["tp"]`` / ``mesh["dp", "tp"]``: :meth:`submesh`, as in torch."""
        return self.submesh(dims)

    async def aclose(self) -> None:
        """Close the groups this mesh made (their collectives still running from
        ``async_op=True`` are cancelled); the parent group stays open."""
        for group in list(self._groups.values()):
            await group.aclose()

    def __repr__(self) -> str:
        return (f"DeviceMesh({_describe(self._sizes, self._names)}, "
                f"coordinate={self._coordinate})")
