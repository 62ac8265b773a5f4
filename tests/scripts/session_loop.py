"""A user's own loop on the session API, unchanged by the strategy the launcher picks
(tests/test_run_quorum_sandbox.py, tests/test_launch_commands.py).

    vpscluster run --cluster c.yaml --strategy diloco --quorum -- python session_loop.py STEPS STEP_S

Trains a small MLP for STEPS loop steps (one thread per rank; a replica that healed from a peer
takes its peer's count), sleeping STEP_S per step to stand for compute. Prints one JSON line per
step ({"step": N}) and, at the end, one with the report's steps and weights' hash. The session's
settings come from the launcher; the script adds only the sync hash lines (the test compares them).
"""

import json
import sys
import time


def main(steps: int, step_s: float) -> int:
    import torch
    from torch import nn
    from torch.nn import functional as F

    from vpscluster import session

    torch.set_num_threads(1)
    s = session.start(strategy={"sync_hashes": True})
    torch.manual_seed(1234)
    model = s.setup(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    data = [(x[i], y[i]) for i in range(len(x))]
    while s.steps < steps and not s.should_stop:
        for xb, yb in s.shard(data, batch_size=8):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            s.step(opt, samples=len(xb), loss=loss)
            opt.zero_grad()
            print(json.dumps({"step": s.steps}), flush=True)
            time.sleep(step_s)
            if s.steps >= steps or s.should_stop:
                break
    report = s.close()
    print(json.dumps({"report": {k: report[k] for k in ("steps", "model_sha256")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2])))
