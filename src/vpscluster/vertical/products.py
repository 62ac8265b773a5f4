"""The products example: a label that needs both modalities, so neither tower alone can learn it.

Each product has a text description (token ids) and a small grey image (8x8). The text says
whether the product is "premium" (one of a few marker words appears among filler words); the
image shows a bright patch in its top or its bottom half, under noise. The label is
premium XOR top: each attribute alone is independent of the label (50% accuracy at best), both
together decide it. `vpscluster vertical train --example products` generates the rows, trains the
split (text tower, image tower, fusion head over the queue) and, with the same head and batches
in one process, each tower alone.
"""

from __future__ import annotations

import random
from typing import Any

VOCAB = 16
MARKERS = (1, 2, 3)  # "premium", "deluxe", "pro"
LENGTH = 8
SIZE = 8


def generate(n: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        premium, top = rng.random() < 0.5, rng.random() < 0.5
        words = [rng.randrange(len(MARKERS) + 1, VOCAB) for _ in range(LENGTH)]
        if premium:
            words[rng.randrange(LENGTH)] = rng.choice(MARKERS)
        image = [[rng.gauss(0.0, 0.3) for _ in range(SIZE)] for _ in range(SIZE)]
        r0 = rng.randrange(0, SIZE // 2 - 1) + (0 if top else SIZE // 2)
        c0 = rng.randrange(0, SIZE - 2)
        for r in range(r0, r0 + 2):
            for c in range(c0, c0 + 3):
                image[r][c] += 1.0
        rows.append({"id": i, "description": words, "image": [[round(v, 3) for v in row] for row in image],
                     "label": int(premium != top)})
    return rows


def text_features(row):
    import torch

    bag = torch.zeros(VOCAB)
    for w in row["description"]:
        bag[int(w)] += 1.0
    return bag


def image_features(row):
    import torch

    return torch.tensor(row["image"], dtype=torch.float32).reshape(1, SIZE, SIZE)


def text_tower(dim: int = 16, hidden: int = 32):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(VOCAB, hidden), nn.ReLU(), nn.Linear(hidden, dim))


def image_tower(dim: int = 16, hidden: int = 32, depth: int = 1):
    """`depth` hidden layers of `hidden` units (a bigger tower, for the pipelining benchmark)."""
    import torch.nn as nn

    layers = [nn.Flatten(), nn.Linear(SIZE * SIZE, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, dim))


def fusion_head(dims: tuple[int, ...] = (16, 16), hidden: int = 32, classes: int = 2):
    """Concatenate the towers' embeddings (in the spec's order), then an MLP to the classes."""
    import torch
    import torch.nn as nn

    class ConcatMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(sum(dims), hidden), nn.ReLU(), nn.Linear(hidden, classes))

        def forward(self, *embs):
            return self.mlp(torch.cat(embs, dim=-1))

    return ConcatMLP()


def spec_doc(data_path: str, nodes: list[str], head: str, staleness: int = 0, epochs: int = 8, dim: int = 16,
             image_hidden: int = 32, image_depth: int = 1) -> dict[str, Any]:
    """The example's spec: text tower on the second node, image tower on the third (wrapping round),
    the head on the cluster's head; `dim` each tower's embedding width, `image_*` the image tower's size."""
    pick = lambda k: nodes[k % len(nodes)]  # noqa: E731
    mod = __name__
    return {
        "data": data_path, "id_column": "id",
        "towers": {
            "text": {"module": f"{mod}:text_tower", "features": f"{mod}:text_features", "columns": ["description"],
                     "args": {"dim": dim}, "nodes": [pick(1)]},
            "image": {"module": f"{mod}:image_tower", "features": f"{mod}:image_features", "columns": ["image"],
                      "args": {"dim": dim, "hidden": image_hidden, "depth": image_depth}, "nodes": [pick(2)]},
        },
        "head": {"module": f"{mod}:fusion_head", "args": {"dims": [dim, dim]}, "label": "label", "loss": "cross_entropy", "node": head},
        "train": {"batch_size": 64, "epochs": epochs, "staleness": staleness, "seed": 0, "val_fraction": 0.2,
                  "optimizer": {"name": "adam", "lr": 0.01}, "timeout_s": 60},
    }
