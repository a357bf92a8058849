# example: blocking.py
# run: netdist launch -n 2 -- python blocking.py
import numpy as np

import netdist

with netdist.connect() as job:              # same configuration as netdist.init()
    grad = np.full(4, float(job.rank + 1), dtype=np.float32)
    work = job.group.all_reduce(grad, op="mean", async_op=True)  # returns at once
    busy = float(np.square(np.arange(1e6)).sum())                # overlaps with it
    work.wait()                                                  # or: await work
    total = job.group.all_gather(np.array([job.rank]))           # blocks until done
    print(f"rank {job.rank}: {grad} {total}")
