"""The peer's side of bench/peer/data_parallel.sh: torch DDP or FSDP2 (fully_shard) over gloo
on N processes of one thread each, with the model, data and optimizer of peer_data_parallel.cpp
(fedshard's ddp and fsdp), so that both train the same parameters.

    python torch_data_parallel.py --algo ddp|fsdp [--ranks N] [--steps S] [--warmup W] [--out FILE]

Model: 4 x Linear(1024, 1024) with ReLU between, torch's default initialisation after
torch.manual_seed(0). Step s of rank r: input and target of 64 x 1024 from torch.randn with a
CPU generator seeded 1000 s + r; MSE loss; SGD (lr 0.01). Every rank meets the others at a
barrier before each step; rank 0 times the step. Prints "step_ms <median over the timed
steps>" and writes rank 0's full parameters after the last step (module order, raw f32) to
FILE. Benchmark-only: never a dependency of fedshard.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from peer_model import LR, batch_of, make_net


def full_parameters(model, algo):
    parts = []
    for p in model.parameters():
        t = p.full_tensor() if algo == "fsdp" else p
        parts.append(t.detach().reshape(-1))
    return torch.cat(parts)


def worker(rank, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    net = make_net()
    if args.algo == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (args.ranks,))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ms = []
    for step in range(args.warmup + args.steps):
        x, y = batch_of(step, rank)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
    params = full_parameters(model, args.algo)
    if rank == 0:
        print(f"step_ms {statistics.median(ms):.4f}", flush=True)
        if args.out:
            params.numpy().astype("float32").tofile(args.out)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.ranks < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"expected --ranks >= 1, --steps >= 1, --warmup >= 0, found {args.ranks}, "
                f"{args.steps}, {args.warmup}")
    with socket.socket() as s:  # a free port on the loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
