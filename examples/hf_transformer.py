"""A Hugging Face Transformers model (GPT-2, built from a config) trained through the session API.

    pip install 'vpscluster[hf]'                                       # transformers
    python examples/hf_transformer.py                                  # one process
    vpscluster run --nodes 2 -- python examples/hf_transformer.py      # 2 local ranks, ddp
    vpscluster run --nodes 2 --strategy diloco --sync-every 10 -- python examples/hf_transformer.py
    vpscluster run --cluster cluster.yaml --strategy auto -- python examples/hf_transformer.py

No weights or tokenizer are downloaded: the model is `GPT2LMHeadModel(GPT2Config(...))`, a small
one with random initial weights, and the data are token sequences this script generates: each
row counts up from a random start by a random stride (mod the vocabulary), so the next token is
predictable from the ones before and the loss falls well below log(vocab) as the model learns
the rule. Swap in `AutoModelForCausalLM.from_pretrained(...)` and a tokenized dataset for real
work; the session lines stay the same. Everything vpscluster-specific is marked `# vpscluster`.
"""

from __future__ import annotations

import argparse
import math

import torch

from vpscluster import session  # vpscluster


def counting_rows(n: int, seq_len: int, vocab: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    rows = (start + stride * torch.arange(seq_len)) % vocab
    return torch.utils.data.TensorDataset(rows)


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048, help="training sequences generated")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    s = session.start()  # vpscluster: rank, world size, strategy from `vpscluster run`
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = s.setup(GPT2LMHeadModel(config))  # vpscluster: DDP (or a DiLoCo replica) around the HF model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    s.resume(optimizer)  # vpscluster: continues a `vpscluster run --resume RUN_DIR`
    train = counting_rows(args.rows, args.seq_len, config.vocab_size, seed=1)
    for epoch in range(s.epoch, args.epochs):  # vpscluster: a resumed run goes on in its epoch
        total, batches = 0.0, 0
        for (ids,) in s.shard(train, batch_size=args.batch_size):  # vpscluster: this rank's part
            ids = ids.to(s.device)
            loss = model(input_ids=ids, labels=ids).loss  # the HF model shifts the labels itself
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            s.step(optimizer, samples=len(ids), loss=loss)  # vpscluster: step, sync, metrics, stop
            optimizer.zero_grad()
            total, batches = total + loss.item(), batches + 1
            if s.should_stop:  # vpscluster: the time budget, agreed by every rank
                break
        if s.is_main:
            print(f"epoch {epoch + 1}: train loss {total / max(1, batches):.3f} "
                  f"(uniform guess: {math.log(config.vocab_size):.3f})", flush=True)
        if s.should_stop:
            break
    report = s.close()  # vpscluster: final sync, every rank holds the same weights
    if s.is_main:
        print(f"{report['steps']} steps, {report['strategy']}, {sum(report['bytes_sent'])} bytes sent, "
              f"weights {report['model_sha256'][:12]}", flush=True)


if __name__ == "__main__":
    main()
