"""The CPU all-reduce of 2 tensor-parallel ranks on this machine: gloo (loopback TCP) against
Octavo's shared-memory one (octavo/distributed/shm_all_reduce.py), per call, for the shapes the
default model all-reduces (a decode batch of 64 rows and a prefill chunk of 1024, hidden 576).

python bench/python/bench_all_reduce.py [--calls 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_peers import machine  # noqa: E402

SHAPES = [(64, 576), (1024, 576)]


def rank_main(rank: int, world: int, port: int, shm_path: str, calls: int, results) -> None:
    from octavo.distributed.shm_all_reduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 0:
        shm = ShmAllReduce(shm_path, 0, world, 60.0)
    dist.barrier()
    if rank:
        shm = ShmAllReduce(shm_path, rank, world, 60.0)
    for shape in SHAPES:
        x = torch.randn(shape)
        for name, reduce in (("gloo", dist.all_reduce), ("shared memory", shm.all_reduce)):
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                reduce(x)
                times.append(time.perf_counter() - start)
                x.mul_(0.5)  # keeps the values finite
            if rank == 0:
                results[(shape, name)] = statistics.median(times[calls // 10:])
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    from octavo.processes import free_port

    print(f"machine: {machine()}")
    results = mp.Manager().dict()
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"octavo-bench-{os.getpid()}")
    try:
        mp.spawn(rank_main, (2, free_port(), path, args.calls, results), nprocs=2)
    finally:
        os.unlink(path)
    print(f"2 ranks, one thread each, median of {args.calls} calls")
    for shape in SHAPES:
        gloo, shm = results[(shape, "gloo")], results[(shape, "shared memory")]
        print(f"[{shape[0]}, {shape[1]}] float32: gloo {gloo * 1e6:.0f} us, shared memory {shm * 1e6:.0f} us "
              f"({gloo / shm:.1f}x)")


if __name__ == "__main__":
    main()
