"""Checkpoint throughput: netdist against a dd-like ceiling, safetensors and DCP.

State: ``--gib`` GiB (default 1) = 16 float32 tensors of 1/16 of it each (64 MiB for
1 GiB), sharded along dim 0 over 2 ranks, plus 32 small replicated tensors.

Measured, alternating methods round by round because this disk is noisy:

- **sync save, 2 ranks**: two worker processes, each holding its share, start together;
  the time is from the first start to the last finish (fsync included everywhere):
  - ``dd``: ``os.write`` of the share's bytes in 8 MiB pieces + fsync (the ceiling);
  - ``safetensors``: ``safetensors.numpy.save_file`` of the share + fsync;
  - ``netdist``: ``save_distributed`` (temp file, CRC-32 blocks, fsync, rename, commit);
  - ``dcp``: ``torch.distributed.checkpoint.save`` of DTensor shards over gloo (when
    torch is importable).
- **async stall**: ``AsyncCheckpointer.save_async`` of the whole state in one process,
  steady state (staging buffers reused), seconds per GiB the caller is blocked, next to a
  plain memcpy of the same bytes measured alternately (the floor: staging is a copy).
- **resharding load**: the 2-rank netdist checkpoint loaded as 4 ranks (one after the
  other, in this process) from a warm page cache, with and without verification.

    python benchmarks/checkpoint.py                  # 1 GiB, 3 rounds
    python benchmarks/checkpoint.py --gib 0.25 --rounds 2 --no-dcp

Files go to a temporary directory under ``--dir`` (default: the system temp dir) and
are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

BIG = 16
SMALL = 32
WORLD = 2


def build_full(gib: float):
    """The full state: 16 big float32 tensors + 32 small ones (deterministic values)."""
    import numpy as np

    per = int(gib * 2**30) // BIG // 4  # float32 elements per big tensor
    cols = 4096
    rows = max(WORLD, per // cols)
    state = {}
    for i in range(BIG):
        state[f"layer{i:02d}.weight"] = np.full((rows, cols), i, dtype=np.float32)
    for i in range(SMALL):
        state[f"layer{i:02d}.norm"] = np.full(1024 + 64 * i, i, dtype=np.float32)
    return state


def local_share(gib: float, rank: int):
    from netdist.checkpoint import flat_shard_metadata, shard_state_dict
    from netdist.checkpoint.metadata import ShardMetadata, TensorShardSpec

    full = build_full(gib)
    base = flat_shard_metadata(full, WORLD)
    specs = {n: (TensorShardSpec.replicated(a.shape, a.dtype) if a.ndim == 1 else
                 base.tensor_specs[n]) for n, a in full.items()}
    meta = ShardMetadata(WORLD, specs)
    local = {n: a.copy() for n, a in shard_state_dict(full, meta, rank).items()}
    return full, meta, local


# ---------------------------------------------------------------------------- worker


def worker(rank: int, gib: float, port: int, use_dcp: bool) -> None:
    """One saving rank: holds its share, runs the method the parent names, reports."""
    import numpy as np

    from netdist.checkpoint import save_distributed

    full, meta, local = local_share(gib, rank)
    del full
    dcp_state = None
    if use_dcp:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,))
        dcp_state = {}
        for name, array in local.items():
            tensor = torch.from_numpy(array)
            placement = [Replicate()] if meta.tensor_specs[name].is_replicated else [Shard(0)]
            dcp_state[name] = DTensor.from_local(tensor, mesh, placement, run_check=False)

    def dd(directory: str) -> None:
        fd = os.open(os.path.join(directory, f"dd_{rank}.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for array in local.values():
                view = memoryview(array.reshape(-1).view(np.uint8))
                for start in range(0, len(view), 8 << 20):
                    piece = view[start:start + (8 << 20)]
                    while piece:
                        piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def safetensors_save(directory: str) -> None:
        import safetensors.numpy

        path = os.path.join(directory, f"st_{rank}.safetensors")
        safetensors.numpy.save_file(local, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def netdist_save(directory: str) -> None:
        save_distributed(local, directory, rank, WORLD, meta)

    def dcp_save(directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state, checkpoint_id=directory)

    methods = {"dd": dd, "safetensors": safetensors_save, "netdist": netdist_save,
               "dcp": dcp_save}
    print("ready", flush=True)
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "quit":
            break
        directory = rest[0]
        os.makedirs(directory, exist_ok=True)
        start, cpu = time.time(), time.process_time()
        methods[command](directory)
        end, cpu = time.time(), time.process_time() - cpu
        print(json.dumps({"start": start, "end": end, "cpu": cpu}), flush=True)
    if use_dcp:
        import torch.distributed as dist

        dist.destroy_process_group()


# ---------------------------------------------------------------------------- parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_saves(args: argparse.Namespace, root: str, total: int, use_dcp: bool) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, HERE, "--worker", str(rank), "--gib",
                               str(args.gib), "--port", str(port)]
                              + ([] if use_dcp else ["--no-dcp"]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for rank in range(WORLD)]
    results: dict[str, list[float]] = {}
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        methods = ["dd", "safetensors", "netdist"] + (["dcp"] if use_dcp else [])
        for round_index in range(args.rounds):
            order = methods if round_index % 2 == 0 else list(reversed(methods))
            for method in order:
                directory = os.path.join(root, f"{method}_{round_index}")
                os.makedirs(directory)
                for proc in procs:
                    proc.stdin.write(f"{method} {directory}\n")
                    proc.stdin.flush()
                times = [json.loads(proc.stdout.readline()) for proc in procs]
                elapsed = max(t["end"] for t in times) - min(t["start"] for t in times)
                results.setdefault(method, []).append(gbps(total, elapsed))
                cpu = sum(t["cpu"] for t in times)
                print(f"  round {round_index} {method:12s} {gbps(total, elapsed):5.2f} GB/s  "
                      f"(cpu {cpu:.2f} s, both ranks)", file=sys.stderr, flush=True)
                if method != "netdist" or round_index != args.rounds - 1:
                    shutil.rmtree(directory)
        for proc in procs:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def measure_async(args: argparse.Namespace, root: str) -> dict:
    """Stall of save_async (steady state, buffers reused) next to a raw 1-thread memcpy
    of the same bytes into warm memory, measured alternately (the floor on this box)."""
    import numpy as np

    from netdist.checkpoint import AsyncCheckpointer

    full = build_full(args.gib)
    gib = sum(a.nbytes for a in full.values()) / 2**30
    warm = {name: array.copy() for name, array in full.items()}
    stalls, memcpys = [], []
    with AsyncCheckpointer(os.path.join(root, "async"), 0, 1, keep_last=1) as ckpt:
        first = ckpt.save_async(full, step=0)
        first.wait()
        for step in range(1, 2 * args.rounds + 2):
            start = time.perf_counter()
            for name, array in full.items():
                np.copyto(warm[name], array)
            memcpys.append((time.perf_counter() - start) / gib)
            future = ckpt.save_async(full, step=step)
            stalls.append(future.stall_seconds / gib)
            future.wait()
    shutil.rmtree(os.path.join(root, "async"))
    return {"first_save_stall_s_per_gib": first.stall_seconds / gib,
            "stall_s_per_gib": statistics.median(stalls), "stalls": stalls,
            "memcpy_s_per_gib": statistics.median(memcpys)}


def measure_load(args: argparse.Namespace, directory: str, total: int) -> dict:
    from netdist.checkpoint import load_distributed

    out = {}
    for verify in (True, False):
        for r in range(4):  # warm the page cache (and the allocator)
            load_distributed(directory, r, 4, verify=verify)
        speeds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for r in range(4):
                load_distributed(directory, r, 4, verify=verify)
            speeds.append(gbps(total, time.perf_counter() - start))
        out["verify" if verify else "no_verify"] = statistics.median(speeds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    parser.add_argument("--no-dcp", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    use_dcp = not args.no_dcp
    if use_dcp:
        try:
            import torch.distributed.checkpoint  # noqa: F401
        except Exception:
            use_dcp = False
    if args.worker is not None:
        worker(args.worker, args.gib, args.port, use_dcp)
        return

    full = build_full(args.gib)
    total = sum(a.nbytes for a in full.values())
    del full
    root = tempfile.mkdtemp(prefix="netdist-ckpt-bench-", dir=args.dir)
    try:
        print(f"state: {total / 2**30:.2f} GiB ({BIG} big + {SMALL} small tensors), "
              f"{WORLD} ranks, {args.rounds} rounds, dcp={'yes' if use_dcp else 'no'}",
              file=sys.stderr, flush=True)
        saves = run_saves(args, root, total, use_dcp)
        load_dir = os.path.join(root, f"netdist_{args.rounds - 1}")
        loads = measure_load(args, load_dir, total)
        shutil.rmtree(load_dir)
        stall = measure_async(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {m: statistics.median(v) for m, v in saves.items()}
    figures = {"save_gbps_median": medians, "save_gbps_all": saves,
               "reshard_load_2_to_4_gbps": loads, "async": stall}
    print(f"\nsync save, {WORLD} ranks (median GB/s, fsync'd):")
    for method, value in medians.items():
        print(f"  {method:12s} {value:5.2f}   ({', '.join(f'{x:.2f}' for x in saves[method])})")
    ceiling = medians["dd"]
    target = 0.9 * ceiling
    if "dcp" in medians:
        target = min(target, 1.2 * medians["dcp"])
    print(f"  target: >= {target:.2f} GB/s (min of 0.9 x dd"
          + (", 1.2 x dcp" if "dcp" in medians else "") + f"): "
          f"{'met' if medians['netdist'] >= target else 'NOT met'}")
    print(f"async stall: {stall['stall_s_per_gib']:.3f} s/GiB steady state, raw 1-thread "
          f"memcpy {stall['memcpy_s_per_gib']:.3f} s/GiB alongside (first save, allocating "
          f"staging: {stall['first_save_stall_s_per_gib']:.3f} s/GiB; AsyncCheckpointer."
          f"reserve() moves that out of the loop); target <= 0.1: "
          f"{'met' if stall['stall_s_per_gib'] <= 0.1 else 'NOT met'}")
    print(f"resharding load 2 -> 4 ranks, warm cache: {loads['verify']:.2f} GB/s verified, "
          f"{loads['no_verify']:.2f} GB/s unverified; target >= 1: "
          f"{'met' if loads['verify'] >= 1.0 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
