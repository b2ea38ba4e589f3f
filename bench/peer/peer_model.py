"""The model, data and loss the torch and torchft sides of bench/peer/ train
(torch_data_parallel.py, torchft_local_sgd.py), as peer_model.hpp makes them for fedshard's.

Model: 4 x Linear(1024, 1024) with ReLU between, torch's initialisation after
torch.manual_seed(0). Data: step s of rank (or group) r reads 64 x 1024 inputs and targets from
torch.randn with a CPU generator seeded 1000 s + r. Loss: MSE. SGD's rate 0.01.
"""

import torch
import torch.nn as nn

WIDTH = 1024
BATCH = 64
LR = 0.01


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def batch_of(step, r):
    gen = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
