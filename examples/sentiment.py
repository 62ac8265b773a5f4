"""A tiny sentiment classifier over comments this script writes itself (positive or negative).

    python examples/sentiment.py                                # one process
    vpscluster run --nodes 2 -- python examples/sentiment.py   # 2 local ranks, ddp
    vpscluster run --nodes 2 --strategy diloco --sync-every 8 -- python examples/sentiment.py

Each comment is a few words from a template ("the delivery was really great", "not worth it,
broken after a week"), negations included; words are hashed into a fixed vocabulary and the
model averages their embeddings (EmbeddingBag) into a small classifier. The same seed writes the
same rows on every rank; `s.shard` gives each rank its part. Lines specific to vpscluster are
marked `# vpscluster`.
"""

from __future__ import annotations

import argparse
import random
import zlib

import torch
from torch import nn
from torch.nn import functional as F

from vpscluster import session  # vpscluster

VOCAB = 4096
LENGTH = 12  # words per comment, padded with 0
SUBJECTS = ["the delivery", "this phone", "the support team", "the app", "my order", "the hotel", "this product"]
GOOD = ["great", "excellent", "fast", "helpful", "lovely", "perfect", "reliable"]
BAD = ["terrible", "slow", "broken", "rude", "awful", "useless", "late"]
FILLER = ["really", "quite", "honestly", "so", "very", "just"]


def word_id(word: str) -> int:
    return 1 + zlib.crc32(word.encode()) % (VOCAB - 1)  # 0 is padding


def write_rows(n: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        positive = rng.random() < 0.5
        negated = rng.random() < 0.25  # "not great" is negative, "not bad" is positive
        words = (GOOD if positive != negated else BAD)
        text = f"{rng.choice(SUBJECTS)} was {rng.choice(FILLER)} {'not ' if negated else ''}{rng.choice(words)}"
        if rng.random() < 0.5:
            text += f" and {rng.choice(FILLER)} {rng.choice(words if not negated else (BAD if positive else GOOD))}"
        ids = [word_id(w) for w in text.split()][:LENGTH]
        rows.append((torch.tensor(ids + [0] * (LENGTH - len(ids))), int(positive)))
    return rows


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, 32, mode="mean", padding_idx=0)
        self.pairs = nn.EmbeddingBag(VOCAB, 32, mode="mean", padding_idx=0)  # word pairs ("not great")
        self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pair_ids = (ids[:, :-1] * 31 + ids[:, 1:]) % (VOCAB - 1) + 1
        pair_ids = torch.where((ids[:, :-1] == 0) | (ids[:, 1:] == 0), torch.zeros_like(pair_ids), pair_ids)
        return self.head(torch.cat([self.embed(ids), self.pairs(pair_ids)], dim=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=4096, help="training comments written")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    s = session.start()  # vpscluster
    torch.manual_seed(0)
    model = s.setup(BagClassifier())  # vpscluster
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    s.resume(optimizer)  # vpscluster: continues a `vpscluster run --resume RUN_DIR`
    train, test = write_rows(args.rows, seed=1), write_rows(1000, seed=2)
    for epoch in range(s.epoch, args.epochs):  # vpscluster: a resumed run goes on in its epoch
        total, batches = 0.0, 0
        for ids, labels in s.shard(train, batch_size=args.batch_size):  # vpscluster
            ids, labels = ids.to(s.device), labels.to(s.device)
            loss = F.cross_entropy(model(ids), labels)
            loss.backward()
            s.step(optimizer, samples=len(labels), loss=loss)  # vpscluster
            optimizer.zero_grad()
            total, batches = total + loss.item(), batches + 1
            if s.should_stop:  # vpscluster
                break
        if s.is_main:
            print(f"epoch {epoch + 1}: train loss {total / max(1, batches):.3f}", flush=True)
        if s.should_stop:
            break
    report = s.close()  # vpscluster
    if s.is_main:
        plain = s.unwrap().eval()
        with torch.no_grad():
            ids = torch.stack([r[0] for r in test])
            labels = torch.tensor([r[1] for r in test])
            acc = (plain(ids.to(s.device)).argmax(1).cpu() == labels).float().mean().item()
        print(f"test accuracy {acc:.1%}; {report['steps']} steps, {report['strategy']}, "
              f"{sum(report['bytes_sent'])} bytes sent, weights {report['model_sha256'][:12]}", flush=True)


if __name__ == "__main__":
    main()
