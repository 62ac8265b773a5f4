"""The plain baseline: a GPT trained with nothing but torch, the recipe users follow today.

    torchrun --nproc-per-node 2 torchrun_ddp.py --data corpus.txt --out result.json [options]

torchrun + `init_process_group("env://")` + DistributedDataParallel + DistributedSampler +
AdamW: the PyTorch DDP tutorial, applied to a small GPT. It imports nothing from vpscluster on
purpose; the model, the byte-level data and the learning-rate schedule are copied so that
`vpscluster bench wan` compares like with like:

- model: GPT-2-style pre-norm decoder, learned positions, tied output head (same shapes and
  initialisation as vpscluster's `model.py` for the same --d-model/--n-layer/--n-head/--seq-len);
- data: every byte is a token; the last --val-fraction of the file is validation; training
  samples are windows of seq_len + 1 bytes at stride seq_len; validation uses the same
  --eval-batches x --batch-size windows, evenly spaced over the split, as vpscluster;
- AdamW (betas 0.9/0.95, decay on matrices only), linear warm-up then cosine decay, gradient
  clipping at 1.0.

Rank 0 writes --out: a JSON document with the step losses, evaluations (step, tokens, training
seconds, val_loss), totals (steps, tokens, wall seconds, tokens/s) and an estimate of the
compute utilisation: after training, --measure-compute-steps forward/backward passes are timed
under `no_sync()` (no communication, no optimizer step, so the weights do not change); compute
seconds = steps x that time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention(d_model, n_head)
        self.ln2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, d_model, n_layer, n_head, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class Windows(Dataset):
    """Windows of seq_len + 1 bytes at stride seq_len: (input, next-byte target)."""

    def __init__(self, tokens, seq_len):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        w = torch.from_numpy(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


def lr_at(args, step):
    if args.warmup_steps and step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    horizon = args.lr_decay_steps or args.max_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, horizon - args.warmup_steps))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, val, args):
    n = len(val)
    wanted = min(args.eval_batches * args.batch_size, n)
    idx = np.linspace(0, n - 1, wanted).round().astype(np.int64)
    model.eval()
    losses = []
    for i in range(0, wanted, args.batch_size):
        x, y = zip(*(val[int(j)] for j in idx[i : i + args.batch_size]))
        losses.append(model(torch.stack(x), torch.stack(y)).item())
    model.train()
    return sum(losses) / len(losses)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a text file (bytes are tokens)")
    p.add_argument("--out", required=True, help="rank 0 writes the result JSON here")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--lr-decay-steps", type=int, default=0, help="cosine horizon (default: --max-steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: CPUs / local ranks)")
    p.add_argument("--measure-compute-steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600.0, help="time-out of every collective")
    return p.parse_args()


def main():
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))

    data = np.fromfile(args.data, dtype=np.uint8)
    n_val = int(len(data) * args.val_fraction)
    train_set = Windows(data[: len(data) - n_val], args.seq_len)
    val_set = Windows(data[len(data) - n_val :], args.seq_len)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = GPT(256, args.d_model, args.n_layer, args.n_head, args.seq_len).to(device)
    ddp = DDP(model)  # broadcasts rank 0's weights, all-reduces gradients during backward
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    tokens_per_step = args.batch_size * args.seq_len * world
    evals = [{"step": 0, "tokens": 0, "train_seconds": 0.0, "val_loss": evaluate(model, val_set, args)}]
    losses, step, epoch, train_seconds = [], 0, 0, 0.0
    start = time.perf_counter()
    done = False
    while not done:
        sampler.set_epoch(epoch)
        for x, y in loader:
            t0 = time.perf_counter()
            step += 1
            for g in opt.param_groups:
                g["lr"] = lr_at(args, step)
            loss = ddp(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            # Every rank must stop after the same step: agree on the budget (MAX of a flag).
            over = torch.tensor([int(args.time_budget is not None and time.perf_counter() - start >= args.time_budget)], device=device)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            train_seconds += time.perf_counter() - t0
            losses.append(loss.item())
            done = bool(over.item()) or step >= args.max_steps
            if done or step % args.eval_every == 0:
                evals.append({"step": step, "tokens": step * tokens_per_step, "train_seconds": train_seconds,
                              "val_loss": evaluate(model, val_set, args)})
            if done:
                break
        epoch += 1
    wall = time.perf_counter() - start

    # Compute-only time per step: forward + backward without communication or update.
    per_step = []
    for x, y in itertools.islice(iter(loader), args.measure_compute_steps):
        t0 = time.perf_counter()
        with ddp.no_sync():
            ddp(x.to(device), y.to(device)).backward()
        opt.zero_grad(set_to_none=True)
        per_step.append(time.perf_counter() - t0)
    compute_step_s = sorted(per_step)[len(per_step) // 2] if per_step else None
    compute_all = [None] * world
    dist.all_gather_object(compute_all, compute_step_s)
    if rank == 0:
        known = [c for c in compute_all if c is not None]
        compute_seconds = step * sum(known) / len(known) if known else None
        result = {
            "strategy": "baseline-torchrun-ddp",
            "world_size": world,
            "steps": step,
            "tokens": step * tokens_per_step,
            "wall_seconds": wall,
            "train_seconds": train_seconds,
            "tokens_per_s": step * tokens_per_step / wall,
            "compute_seconds_estimate": compute_seconds,
            "compute_utilization": compute_seconds / wall if compute_seconds else None,
            "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
            "final_val_loss": evals[-1]["val_loss"],
            "evals": evals,
            "losses": losses,
            "num_params": sum(p.numel() for p in model.parameters()),
            "args": vars(args),
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    # DDP's reducer holds the process group: freed by the interpreter's last garbage collection,
    # gloo's worker thread can still be releasing a finished all-reduce then, and torch 2.x aborts
    # the process (SIGABRT, "terminate called without an active exception") after a good run.
    # Freed here, while the interpreter is whole, the group's threads end cleanly.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
