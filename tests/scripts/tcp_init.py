"""Joins a hard-coded tcp:// address and sets RANK/WORLD_SIZE itself (tests/test_script_hints.py; never run)."""

from os import environ

import torch.distributed as dist
from torch.multiprocessing import spawn as start

environ.update({"RANK": "0", "WORLD_SIZE": "4"})


def main(rank):
    dist.init_process_group(backend="gloo", init_method="tcp://192.168.1.10:23456", rank=rank, world_size=4)


if __name__ == "__main__":
    start(main, nprocs=4)
