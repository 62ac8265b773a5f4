"""A plain DDP training script, written the way PyTorch's DDP tutorial writes one.

Nothing here knows about vpscluster: env:// initialisation from what torchrun sets, a
DistributedSampler, DistributedDataParallel, a few epochs of SGD. At the end every rank prints
a SHA-256 of its state_dict (and writes it to --out DIR/rank-N.sha256 when given), so a test can
check that all ranks hold identical weights.

    torchrun --nproc-per-node 2 ddp_tutorial.py --epochs 2
"""

import argparse
import gc
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def state_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// : RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    # Different seeds per rank: DDP's initial broadcast must make the replicas equal anyway.
    torch.manual_seed(1234 + rank)
    model = ToyModel()
    ddp_model = DDP(model)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=gen)
    y = torch.randn(256, 5, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(xb), yb)
            loss.backward()
            optimizer.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)

    digest = state_hash(model)
    print(f"STATE_SHA256 rank={rank} world={world_size} {digest}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank-{rank}.sha256"), "w") as f:
            f.write(digest + "\n")
    # Exit hygiene a plain script needs with torch 2.x under load: DDP's reducer holds the process
    # group, and freed only by the interpreter's final garbage collection, gloo's worker thread
    # can still be releasing a finished all-reduce and the rank aborts (SIGABRT, "terminate
    # called without an active exception") after printing its hash. Free it while Python is whole.
    del ddp_model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
