"""One replica group of the quorum engine, written against the session API (tests/test_quorum_session.py).

    TORCHFT_LIGHTHOUSE=http://HOST:PORT VPSC_REPLICA_GROUP=I/N \
        python quorum_replica.py RUN_DIR STEPS H WIRE STEP_S [CHECKPOINT_EVERY [resume]]

A user's loop, unchanged by the quorum: `setup`, `shard`, `step`, `close` (and, with
CHECKPOINT_EVERY > 0, checkpoints every that many steps; with `resume`, `resume` before the loop).
Trains a small MLP on its replica group's shard until the loop's step count reaches STEPS (a
replica that joined late takes its peer's count), sleeping STEP_S per step to stand for compute.
Prints one JSON line {"joined_at_step": N} when it is ready to train, the session's sync hash
lines on stdout ("diloco sync: ..."), and at the end one JSON line with the report.
"""

import json
import sys
import time


def main(run_dir: str, steps: int, sync_every: int, wire: str, step_s: float, checkpoint_every: int = 0,
         resume: bool = False) -> int:
    import torch
    from torch import nn
    from torch.nn import functional as F

    from vpscluster import session

    torch.set_num_threads(1)
    s = session.start(run_dir=run_dir, strategy={"name": "diloco", "quorum": True, "sync_every": sync_every,
                                                 "wire_dtype": wire, "sync_hashes": True, "outer_lr": 0.7,
                                                 "quorum_timeout_s": 8, "sync_timeout_s": 5},
                      checkpoint_every=checkpoint_every, resume=resume)
    torch.manual_seed(int(time.time() * 1e6) % 2**31)  # different initial weights: the first quorum aligns them
    model = s.setup(nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    s.resume(opt)  # nothing unless resume
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    data = [(x[i], y[i]) for i in range(len(x))]
    print(json.dumps({"joined_at_step": s.steps}), flush=True)
    while s.steps < steps:
        for xb, yb in s.shard(data, batch_size=8):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            s.step(opt, samples=len(xb), loss=loss)
            opt.zero_grad()
            time.sleep(step_s)
            if s.steps >= steps or s.should_stop:  # should_stop: a drain (or a stop) asked at a sync
                break
        if s.should_stop:
            break
    report = s.close()
    print(json.dumps({"report": {k: report[k] for k in ("steps", "model_sha256", "strategy_details")}}), flush=True)
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], int(a[1]), int(a[2]), a[3], float(a[4]), int(a[5]) if len(a) > 5 else 0,
                  len(a) > 6 and a[6] == "resume"))
