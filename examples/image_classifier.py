"""A small CNN that tells four shapes apart, on images this script draws itself.

    python examples/image_classifier.py                                # one process
    vpscluster run --nodes 2 -- python examples/image_classifier.py   # 2 local ranks, ddp
    vpscluster run --nodes 2 --strategy diloco --sync-every 8 --wire-dtype int8 -- python examples/image_classifier.py
    vpscluster run --cluster cluster.yaml --strategy diloco -- python examples/image_classifier.py

Each image is 16x16 grey with noise and one shape at a random place: a horizontal bar, a vertical
bar, a hollow square or a cross (the label). The same seed draws the same images on every rank;
`s.shard` gives each rank its part. Everything vpscluster-specific is marked `# vpscluster`.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from vpscluster import session  # vpscluster

SIZE = 16
CLASSES = ("horizontal bar", "vertical bar", "square", "cross")


def draw(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = 0.3 * torch.randn(n, 1, SIZE, SIZE, generator=g)
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    for i in range(n):
        r, c = (int(v) for v in torch.randint(3, SIZE - 3, (2,), generator=g))
        k = int(labels[i])
        img = images[i, 0]
        if k == 0:
            img[r, c - 3:c + 4] += 1.0
        elif k == 1:
            img[r - 3:r + 4, c] += 1.0
        elif k == 2:
            img[r - 2, c - 2:c + 3] += 1.0
            img[r + 2, c - 2:c + 3] += 1.0
            img[r - 2:r + 3, c - 2] += 1.0
            img[r - 2:r + 3, c + 2] += 1.0
        else:
            img[r, c - 2:c + 3] += 1.0
            img[r - 2:r + 3, c] += 1.0
    return torch.utils.data.TensorDataset(images, labels)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * (SIZE // 4) ** 2, len(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def accuracy(model: nn.Module, data, device) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        right = (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return right / len(y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=2048, help="training images drawn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    s = session.start()  # vpscluster: rank, world size, strategy from `vpscluster run`
    torch.manual_seed(0)
    model = s.setup(SmallCNN())  # vpscluster
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    s.resume(optimizer)  # vpscluster: continues a `vpscluster run --resume RUN_DIR`
    train, test = draw(args.samples, seed=1), draw(512, seed=2)
    for epoch in range(s.epoch, args.epochs):  # vpscluster: a resumed run goes on in its epoch
        total, batches = 0.0, 0
        for x, y in s.shard(train, batch_size=args.batch_size):  # vpscluster: this rank's part
            x, y = x.to(s.device), y.to(s.device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            s.step(optimizer, samples=len(x), loss=loss)  # vpscluster: step, sync, metrics, stop
            optimizer.zero_grad()
            total, batches = total + loss.item(), batches + 1
            if s.should_stop:  # vpscluster: the time budget, agreed by every rank
                break
        if s.is_main:
            print(f"epoch {epoch + 1}: train loss {total / max(1, batches):.3f}", flush=True)
        if s.should_stop:
            break
    report = s.close()  # vpscluster: final sync, every rank holds the same weights
    if s.is_main:
        print(f"test accuracy {accuracy(s.unwrap(), test, s.device):.1%}; {report['steps']} steps, "
              f"{report['strategy']}, {sum(report['bytes_sent'])} bytes sent, weights {report['model_sha256'][:12]}",
              flush=True)


if __name__ == "__main__":
    main()
