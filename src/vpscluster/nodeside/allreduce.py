"""All-reduce sweep: one process per node, the real torch.distributed backend, env:// rendezvous.

Self-contained (sent as source, see `vpscluster.nodeside`; needs torch). Rank 0 prints one JSON object with, per message
size, the mean seconds per all-reduce (the slowest rank's time, as nccl-tests reports it).
The first all-reduce of every size is checked: each rank contributes rank+1, so every element
must come back as n(n+1)/2 — a sweep that returns wrong sums is an error, not a number.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and GLOO_SOCKET_IFNAME where known).
Usage: python allreduce.py '{"sizes": [4096, ...], "min_time_s": 0.3, "max_iters": 50,
                               "timeout_s": 60, "backend": "gloo"}'
"""

import json
import math
import os
import sys
import time


def _store(dist, rank, world, timeout):
    """The sweep's TCPStore, its server (rank 0) listening on MASTER_ADDR only.

    env:// would listen on every interface whatever MASTER_ADDR says (torch's TCPStore ignores
    the host), open to anyone for the sweep's length. Rank 0 hands it a socket bound to
    MASTER_ADDR instead (`master_listen_fd`, as nodeside/torchrun.py does for torchrun's stores;
    this program travels alone, so the few lines are its own)."""
    import ipaddress
    import socket

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    kwargs = {}
    if rank == 0:
        ip = ipaddress.ip_address(host)  # the probe always gives an address, never a name
        sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        kwargs["master_listen_fd"] = sock.detach()
    return dist.TCPStore(host, port, world, rank == 0, timeout=timeout, **kwargs)


def main(argv):
    opts = json.loads(argv[1])
    import datetime

    import torch
    import torch.distributed as dist

    backend = opts.get("backend", "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(opts.get("timeout_s", 60)))
    rank_env, world_env = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=_store(dist, rank_env, world_env, timeout), rank=rank_env,
                            world_size=world_env, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = []
    sweep_start = time.perf_counter()
    try:
        for size in opts["sizes"]:
            numel = max(1, int(size) // 4)
            t = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
            dist.barrier()  # start together: the warm-up time may become the sample (see below)
            start = time.perf_counter()
            dist.all_reduce(t)  # warm-up and correctness check at once
            sync()
            once = time.perf_counter() - start
            expected = world * (world + 1) / 2
            ok = bool(torch.all(t == expected).item())
            # The warm-up time tells how many calls fit in min_time_s. A size whose single call
            # exceeds max_size_s (or a sweep past its budget) keeps the warm-up as its one sample
            # and ends the sweep: larger sizes would only take longer. Rank 0 decides for all.
            n = min(int(opts.get("max_iters", 50)), max(1, math.ceil(float(opts.get("min_time_s", 0.3)) / max(once, 1e-6))))
            last = once > float(opts.get("max_size_s", 1.5)) or time.perf_counter() - sweep_start > float(opts.get("budget_s", 20))
            decision = torch.tensor([n, int(last)], dtype=torch.int64, device=device)
            dist.broadcast(decision, 0)
            n, last = int(decision[0].item()), bool(decision[1].item())
            if last:
                elapsed = torch.tensor([once], dtype=torch.float64, device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                results.append({"size_bytes": numel * 4, "iters": 1, "time_s": float(elapsed.item()), "correct": ok})
                break
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            sync()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            results.append({"size_bytes": numel * 4, "iters": n, "time_s": float(elapsed.item()) / n, "correct": ok})
            # Skip sizes that would take far too long (same decision on every rank: the time is
            # the all-reduced maximum).
            later = [x for x in opts["sizes"] if x > size]
            if later and results[-1]["time_s"] * later[0] / size > 2 * float(opts.get("max_size_s", 1.5)):
                break
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"backend": backend, "world_size": world, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
