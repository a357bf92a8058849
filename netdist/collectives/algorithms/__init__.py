"""The algorithms that move a collective's bytes, each over a ``Channel`` in group ranks.

``netdist.collectives.routes`` chooses among them; ``netdist.collectives.ops`` runs the
chosen one. Each executes a pure plan from ``netdist.collectives.plan``:

- ``ring``: pipelined ring reduce-scatter / all-gather / all-reduce and chain broadcast
- ``doubling``: recursive-doubling all-reduce
- ``trees``: binomial-tree broadcast and reduce (arrays and byte strings)
- ``bruck``: Bruck's all-gather (arrays and byte strings)
- ``linear``: gather, scatter, all-to-all
- ``barrier``: the dissemination barrier and the monitored barrier
- ``receive``: checked and exact receives, concurrent steps, shared by the above
"""
