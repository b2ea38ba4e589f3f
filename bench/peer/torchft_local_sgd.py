"""The peer's side of bench/peer/local_sgd.sh: one replica group (one process, one thread) of
torchft's LocalSGD, with the model, data and optimizer of peer_local_sgd.cpp (fedshard's
fl_fsdp over a Gloo link), so that both train the same parameters.

    python torchft_local_sgd.py --group G --lighthouse URL [--groups 2] [--optim sgd|adamw]
                                [--algo localsgd|diloco] [--steps S] [--k K] [--warmup W]
                                [--out FILE]

--algo diloco: torchft's DiLoCo instead, its outer optimizer SGD with Nesterov momentum (lr
0.7, momentum 0.9), against fedshard's diloco.

Model: 4 x Linear(1024, 1024) with ReLU between, torch's default initialisation after
torch.manual_seed(0). Step s of group g: input and target of 64 x 1024 from torch.randn with a
CPU generator seeded 1000 s + g; MSE; SGD (lr 0.01) or AdamW (its defaults); LocalSGD averages the parameters over
the groups every K steps (after the optimizer's step), through torchft's Manager (quorum from
the lighthouse, ProcessGroupGloo). Group 0 prints "step_ms <the mean of the steps after the
warm-up ones>" (syncs amortized) and writes its parameters after the last step (module
order, raw f32) to FILE. Benchmark-only: never a dependency of fedshard.
"""

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo, LocalSGD

from peer_model import LR, batch_of, make_net


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--optim", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--algo", choices=["localsgd", "diloco"], default="localsgd")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not 0 <= args.group < args.groups or args.steps < 1 or args.k < 1 or args.warmup < 0:
        p.error("expected 0 <= --group < --groups, --steps >= 1, --k >= 1, --warmup >= 0")
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    net = make_net()
    if args.optim == "adamw":
        opt = torch.optim.AdamW(net.parameters())
    else:
        opt = torch.optim.SGD(net.parameters(), lr=LR)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=net.load_state_dict,
        state_dict=net.state_dict,
        min_replica_size=args.groups,
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=60),
        init_sync=False,  # every group starts from the same seed: no state copied at the start
        use_async_quorum=args.algo != "diloco",  # DiLoCo requires a synchronous quorum
    )
    total = args.warmup + args.steps
    start = None
    if args.algo == "diloco":
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        wrapper = DiLoCo(manager, [net], opt, outer, sync_every=args.k, pin_memory=False)
    else:
        wrapper = LocalSGD(manager, net, opt, sync_every=args.k)
    with wrapper:
        for step in range(total):
            if step == args.warmup:
                start = time.perf_counter()
            x, y = batch_of(step, args.group)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    mean_ms = (time.perf_counter() - start) * 1e3 / args.steps
    if args.group == 0:
        print(f"step_ms {mean_ms:.4f}", flush=True)
        if args.out:
            torch.cat([q.detach().reshape(-1) for q in net.parameters()]).numpy().tofile(args.out)
    manager.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
