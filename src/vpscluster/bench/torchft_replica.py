"""One torchft replica group for `vpscluster bench torchft` (run as `python -m vpscluster.bench.torchft_replica`).

    python -m vpscluster.bench.torchft_replica REPLICA_ID LIGHTHOUSE_ADDR STEPS SYNC_EVERY STEP_S LOG [HIDDEN [ADDRESS]]

One process = one replica group of world size 1: its own TCPStore, a torchft Manager over
ProcessGroupGloo (10 s time-outs), and torchft's DiLoCo (AdamW inside, Nesterov SGD lr 0.7 /
momentum 0.9 outside) on an MLP (64 -> HIDDEN -> 8) with its own data. ADDRESS (default
127.0.0.1) is where the other replicas reach this one's store and manager: a sandbox node's. Every inner step sleeps STEP_S more, to
stand for compute. After each outer sync it appends one JSON line to LOG: wall time, manager
step, participants, and a hash of its weights. Ends after STEPS outer syncs.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from datetime import timedelta


def weights_hash(model) -> str:
    """A hash of the weights' bytes (through a list: torchft's environment may lack numpy)."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    rid, lighthouse, steps, sync_every, step_s, log_path = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4]), argv[5]
    hidden = int(argv[6]) if len(argv) > 6 else 256
    address = argv[7] if len(argv) > 7 else "127.0.0.1"
    torch.manual_seed(0)  # the same initial weights on every replica
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}

    def load_state_dict(sd: dict) -> None:  # a returning replica heals from a peer's state
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        outer.load_state_dict(sd["outer"])

    from vpscluster.train.strategies.quorum_diloco import checkpoint_transport

    store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica-{rid}",
                      store_addr=address, store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      hostname=address, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=10),
                      checkpoint_transport=checkpoint_transport(address, 10))
    data = torch.Generator().manual_seed(1000 + int(rid))  # each replica its own batches
    with open(log_path, "a") as log, DiLoCo(manager, [model], inner, outer, sync_every=sync_every) as diloco:
        while manager.current_step() < steps:
            x = torch.randn(32, 64, generator=data)
            y = torch.randint(8, (32,), generator=data)
            inner.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()  # DiLoCo's hook: every sync_every steps, the outer sync over the current quorum
            time.sleep(step_s)
            if diloco._local_step == 0:  # an outer sync just ended
                log.write(json.dumps({"t": time.time(), "replica": rid, "step": manager.current_step(),
                                      "participants": manager.num_participants(), "hash": weights_hash(model)}) + "\n")
                log.flush()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
