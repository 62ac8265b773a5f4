"""A small script on the session API (vpscluster.session): a linear model fitted for a few steps,
one thread per rank, for tests of `vpscluster run` on a cluster.

    python session_steps.py [--steps 8] [--wait-for PATH]   # waits (at most 120 s) for PATH first

Under `vpscluster run --resume` it continues from the newest checkpoint (`--checkpoint-every N`)
up to `--steps` in all.

`--wait-for` holds every rank after the group formed until the file appears, so a test can act
on a run that is certainly still going (the sandbox's nodes see this machine's files).
"""

import argparse
import os
import time

import torch
from torch import nn

from vpscluster import session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--wait-for", metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    s = session.start()
    torch.manual_seed(0)
    model = s.setup(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    s.resume(optimizer)
    if args.wait_for:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.wait_for) and time.monotonic() < deadline:
            time.sleep(0.2)
    g = torch.Generator().manual_seed(s.rank)
    w = torch.arange(8.0) / 8
    while s.steps < args.steps:
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x).squeeze(1) - x @ w) ** 2).mean()
        loss.backward()
        s.step(optimizer, samples=16, loss=loss)
        optimizer.zero_grad()
        if s.should_stop:
            break
    report = s.close()
    if s.is_main:
        print(f"session_steps done: {report['steps']} steps, final loss {report['final_train_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
