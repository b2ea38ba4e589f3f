#!/usr/bin/env python3
"""Benchmark-only peer for bench_link: torch.distributed's Gloo all_reduce between two
processes on the loopback, timed the way bench/bench_link.cpp times fedshard's.

Two processes (rank 0 and 1) join one gloo process group on 127.0.0.1 (a free port), make
2 untimed all_reduce(sum) calls of S MiB of f32, then N timed ones; before every timed call
both pass dist.barrier() and rank 0 times the call alone. Inputs are 1.0 on rank 0 and 2.0
on rank 1; the result must be 3.0 everywhere (exit status 1 otherwise).

Prints one JSON line: {"peer", "MiB", "ms_median", "Gbit_s"} with
Gbit_s = S bytes x 8 / median seconds / 1e9, plus "Gbit_s_mean" = S x 8 x N / total seconds,
which is exactly bench_link's Gbit/s counter (mean over the timed calls).

Usage: torch_gloo_allreduce.py MiB [--iterations N]
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WARMUP = 2  # as bench_link


def free_port():
    # Ask the kernel for an unused port; the tiny window before rank 0 binds it is accepted.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank, port, mib, iterations):
    torch.set_num_threads(1)
    # Keep Gloo's own device on the loopback, like fedshard's options::hostname = 127.0.0.1.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    n = (mib << 20) // 4
    src = torch.full((n,), 1.0 + rank, dtype=torch.float32)
    buf = torch.empty_like(src)
    # torch's all_reduce is in place: refill the buffer before each call (never timed), so
    # every call reduces the same inputs as bench_link's out-of-place calls.
    for _ in range(WARMUP):
        buf.copy_(src)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    seconds = []
    for _ in range(iterations):
        buf.copy_(src)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # synchronous: returns when done
        seconds.append(time.perf_counter() - t0)
    ok = bool(torch.all(buf == 3.0))
    dist.destroy_process_group()
    if not ok:
        print(f"torch_gloo_allreduce: rank {rank}: wrong all_reduce result", file=sys.stderr)
        sys.exit(1)
    if rank == 0:
        bits = (mib << 20) * 8
        median = statistics.median(seconds)
        print(json.dumps({"peer": "torch_gloo", "MiB": mib, "ms_median": median * 1e3,
                          "Gbit_s": bits / median / 1e9,
                          "Gbit_s_mean": bits * iterations / sum(seconds) / 1e9}),
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("MiB", type=int, help="message size in MiB")
    p.add_argument("--iterations", type=int, default=8, help="timed calls (default 8)")
    a = p.parse_args()
    try:
        mp.spawn(run_rank, args=(free_port(), a.MiB, a.iterations), nprocs=2, join=True)
    except Exception as e:  # a rank raised or exited nonzero
        print(f"torch_gloo_allreduce: failed: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
