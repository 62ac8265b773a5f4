"""Vertical split: a model whose towers train on different nodes, each on its own columns, joined by a queue.

    from vpscluster.vertical import spec, launch
    report = launch.train(spec.load("spec.yaml"), cluster=None)    # None: local processes

spec.py       the spec (towers, head, train settings), its checks and the callables it names
data.py       rows, the per-stage column files (only what a stage may see), the batch schedule
wire.py       subjects and messages on NATS JetStream (tensors, batch and sample ids), the inbox
tower.py      a tower stage: forward, publish embeddings, step on gradients (staleness K)
checkpoint.py a stage's checkpoint: on its node's disk and the queue's object store (a stage moves with it)
head.py       the head stage: join by batch, fuse, step, publish gradients, count sample ids
worker.py     the process of one stage on a node
launch.py     place stages, split the data, start them through the executors, restart or move a dead
              one (its node gone: to another live node), collect the report
reference.py  the same model in one process (the K = 0 yardstick, the one-modality baselines)
products.py   the example: text + image, label = premium XOR top
example.py    `vertical train --example products`: generate, train the split, compare
"""
