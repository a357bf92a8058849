# example: trace_window.py
# run: netdist launch -n 2 -- python trace_window.py
import json
import tempfile
from pathlib import Path

import numpy as np

import netdist
from netdist import trace

with netdist.connect() as job:
    where = Path(tempfile.gettempdir()) / f"netdist-trace-{job.config.job_id}"
    grad = np.ones(1024, dtype=np.float32)
    for step in range(6):
        if step == 2:
            trace.start_trace(job, where)     # every rank traces steps 2 and 3 only
        job.group.all_reduce(grad)
        if step == 3:
            path = trace.stop_trace(job)      # writes rank_NNNNN.trace.json
    events = json.loads(path.read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "collective"]
    print(f"rank {job.rank}: {path.name} holds {len(calls)} {calls[0]['name']} calls")
