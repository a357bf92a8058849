# example: reshard_demo.py
import numpy as np

from netdist.checkpoint import (AsyncCheckpointer, flat_shard_metadata, load_distributed,
                                shard_state_dict)

full = {"w": np.arange(20.0).reshape(10, 2), "b": np.arange(3.0)}
spec = flat_shard_metadata(full, world_size=2)    # dim 0: w rows [5, 5], b [2, 1]

for rank in range(2):                             # two ranks save (here one after the other)
    with AsyncCheckpointer("reshard_demo", rank, 2, spec) as checkpointer:
        future = checkpointer.save_async(shard_state_dict(full, spec, rank), step=1)
        future.wait()                             # `await future` in a coroutine

for rank in range(3):                             # three ranks load: resharded on read
    part = load_distributed("reshard_demo", rank, 3)
    print(rank, part["w"][:, 0].tolist(), part["b"].tolist())
