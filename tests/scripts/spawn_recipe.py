"""The hand-written multi-process recipe that breaks under any launcher (tests/test_script_hints.py):
its own processes (mp.spawn) and its own MASTER_ADDR/MASTER_PORT, here an address nobody listens
on, so the group never forms (within a short time-out, for the test)."""

import os
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=3))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"] = "10.255.255.1"
    os.environ["MASTER_PORT"] = "29500"
    mp.spawn(worker, args=(2,), nprocs=2)
