"""PURE: what each FSDP ``ShardingStrategy`` shards, answered by a policy object.

FSDP never branches on the strategy. It builds one ``ShardingPolicy`` for its group
(``ShardingPolicy.build``) and asks it questions: are parameters held as a shard and
gathered around each use (``shards_parameters``, torch's ``reshard_after_forward``)? are
gradients and optimizer state sharded (``shards_gradients``)? must whole parameters be
rebuilt from the shards after they change (``regathers_parameters``)? are the shards
replicated across nodes (``replicates_shards``)? which subgroups carry the traffic
(``group_plan``)? The strategies differ only in the table of ``_TRAITS`` below and in
the rank layout::

    strategy       shard group                replica group (gradients averaged)
    FULL_SHARD     the whole group            none
    SHARD_GRAD_OP  the whole group            none
    NO_SHARD       none                       the whole group (when it has > 1 rank)
    HYBRID_SHARD   ranks of one node:         ranks holding the same shard in every
                   ``r // s * s .. + s - 1``  node: ``r % s, r % s + s, ...`` (> 1 node)

(``s = intra_node_size``). Nothing here imports ``asyncio`` or ``socket``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ShardingStrategy", "ShardingPolicy", "GroupPlan", "WHOLE_GROUP"]


class ShardingStrategy(enum.Enum):
    """What FSDP shards (see ``netdist.parallel.fsdp``'s table)."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept a member, its name (``"FULL_SHARD"``) or its value (``"full_shard"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() in (member.value, member.name.lower()):
                    return member
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown sharding strategy {value!r} (expected one of {names})")

    @property
    def per_node(self) -> bool:
        """Sharded inside nodes of ``intra_node_size`` ranks, replicated across nodes."""
        return _TRAITS[self].per_node


@dataclass(frozen=True, slots=True)
class _Traits:
    shards_parameters: bool
    """Parameters are held as a shard between uses and all-gathered around each one."""
    shards_gradients: bool
    """Gradients (reduce-scattered) and optimizer state are held as a shard."""
    regathers_parameters: bool
    """Whole parameters are held; after the shards change they are all-gathered again."""
    per_node: bool
    """The shard group is one node of ``intra_node_size`` ranks (HYBRID_SHARD)."""


_TRAITS: dict[ShardingStrategy, _Traits] = {
    ShardingStrategy.FULL_SHARD: _Traits(True, True, False, False),
    ShardingStrategy.SHARD_GRAD_OP: _Traits(False, True, True, False),
    ShardingStrategy.NO_SHARD: _Traits(False, False, False, False),
    ShardingStrategy.HYBRID_SHARD: _Traits(True, True, False, True),
}

WHOLE_GROUP = -1
"""``GroupPlan`` index meaning "the group FSDP was given", not a subgroup."""


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The groups one rank's FSDP talks over, as rank lists (no group is created here).

    ``subgroups`` are created with ``Group.new_group`` in this order on every rank (group
    creation is collective in order). ``shard`` and ``replica`` index into them;
    ``WHOLE_GROUP`` is the group FSDP was given, ``None`` means no such group.
    """

    subgroups: tuple[tuple[int, ...], ...]
    shard: int | None
    replica: int | None


@dataclass(frozen=True, slots=True)
class ShardingPolicy:
    """One rank's answers to what its ``strategy`` shards, for a group of ``world_size``.

    ``shard_size`` ranks share one copy of the parameters (shard ``rank % shard_size``
    each); ``world_size // shard_size`` such copies (replicas) exist. Build it with
    ``build``, which validates ``intra_node_size``.
    """

    strategy: ShardingStrategy
    world_size: int
    rank: int
    shard_size: int
    intra_node_size: int | None = None

    @classmethod
    def build(cls, strategy: ShardingStrategy | str, world_size: int, rank: int,
              intra_node_size: int | None = None) -> ShardingPolicy:
        """The policy of ``strategy`` on ``rank`` of ``world_size`` (``ValueError`` for an
        ``intra_node_size`` that is missing, given without HYBRID_SHARD, or not dividing
        the world size)."""
        strategy = ShardingStrategy.parse(strategy)
        traits = _TRAITS[strategy]
        if not traits.per_node:
            if intra_node_size is not None:
                raise ValueError(f"intra_node_size applies to HYBRID_SHARD only, not "
                                 f"{strategy.name}")
            shard_size = world_size if traits.shards_gradients else 1
            return cls(strategy, world_size, rank, shard_size)
        if isinstance(intra_node_size, bool) or not isinstance(intra_node_size, int) \
                or intra_node_size < 1:
            raise ValueError(f"{strategy.name} needs intra_node_size, an int >= 1 (ranks per "
                             f"node), got {intra_node_size!r}")
        if world_size % intra_node_size:
            raise ValueError(f"{strategy.name}: world size {world_size} is not a multiple of "
                             f"intra_node_size {intra_node_size}; use a world size of "
                             f"k * {intra_node_size} or another intra_node_size")
        return cls(strategy, world_size, rank, intra_node_size, intra_node_size)

    # -- layout ------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """Shards each flat parameter is cut into (1: held whole)."""
        return self.shard_size

    @property
    def shard_index(self) -> int:
        """Which shard this rank holds."""
        return self.rank % self.shard_size

    @property
    def num_replicas(self) -> int:
        """Copies of every shard across the group (gradients are averaged over them)."""
        return self.world_size // self.shard_size

    @property
    def replica_index(self) -> int:
        """Which copy this rank's shard is (0: the one checkpoints name as owner)."""
        return self.rank // self.shard_size

    # -- the questions FSDP asks -------------------------------------------------------

    @property
    def shards_parameters(self) -> bool:
        """Parameters are held as a shard and all-gathered before each unit computes,
        freed after it (torch's ``reshard_after_forward``); False: held whole."""
        return _TRAITS[self.strategy].shards_parameters and self.num_shards > 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are reduce-scattered into a shard and optimizer state is shard-sized;
        False (NO_SHARD): whole gradients, all-reduced, and a replicated checkpoint."""
        return _TRAITS[self.strategy].shards_gradients

    @property
    def regathers_parameters(self) -> bool:
        """Whole parameters are held over sharded updates, so after a step (or a load)
        the updated shards are all-gathered into them again."""
        return _TRAITS[self.strategy].regathers_parameters and self.num_shards > 1

    @property
    def replicates_shards(self) -> bool:
        """The same shards live on several replicas (HYBRID_SHARD across nodes): reduced
        gradient shards are averaged over them, and loaded shards broadcast from
        replica 0."""
        return self.shards_gradients and self.num_replicas > 1

    @property
    def reports_shards(self) -> bool:
        """This rank names itself owner of its shards in a checkpoint (replica 0)."""
        return self.replica_index == 0

    def checkpoint_shard_sizes(self, per_shard: tuple[int, ...]) -> tuple[int, ...]:
        """Per *world* rank sizes of one sharded tensor whose per-shard sizes are
        ``per_shard``: ranks of other replicas own nothing (size 0)."""
        return per_shard + (0,) * (self.world_size - len(per_shard))

    def group_plan(self) -> GroupPlan:
        """The shard and replica groups (see the module docstring's table)."""
        if _TRAITS[self.strategy].per_node:
            size, nodes = self.shard_size, self.num_replicas
            node_groups = [tuple(range(j * size, (j + 1) * size)) for j in range(nodes)]
            replica_groups = [tuple(k + j * size for j in range(nodes)) for k in range(size)]
            replica = nodes + self.shard_index if nodes > 1 else None
            return GroupPlan(tuple(node_groups + replica_groups), self.replica_index, replica)
        if self.shards_gradients:
            return GroupPlan((), WHOLE_GROUP, None)
        return GroupPlan((), None, WHOLE_GROUP if self.world_size > 1 else None)
