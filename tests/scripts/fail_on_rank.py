"""A torchrun script that fails on one rank after the group has formed (for launch failure tests).

    python fail_on_rank.py --rank 1 [--hang]   # the given rank raises; with --hang the others
                                               # sleep instead of finishing (teardown must end them)
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--hang", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"rank {rank} joined a group of {dist.get_world_size()}, sum {t[0].item():.0f}", flush=True)
    if rank == args.rank:
        raise RuntimeError(f"deliberate failure on rank {rank} (pid {os.getpid()})")
    if args.hang:
        time.sleep(3600)
    dist.barrier()  # the failed rank never arrives: the others see a lost peer


if __name__ == "__main__":
    main()
