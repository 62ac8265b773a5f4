"""The head stage: join the towers' embeddings by batch, fuse, step, and send each tower its gradient.

It holds the only copy of the labels. Every batch's sample ids must be the schedule's, the same
from every tower; per epoch it counts them, and the report says whether each sample was trained
exactly once. After training it scores the validation ids the towers send (phase `eval`).

The embeddings are pulled in the background (up to K + 1 per tower, the consumers' max_pending),
and the gradients' publishes and the embeddings' acks are confirmed later (queue.client.InFlight,
all confirmed before the report): a step is the fusion's work plus the wait for a batch that has
not come, not a chain of queue round trips. The report's `head_wait_share` (the head waited on
the towers) and `head_cpu_share` (its CPU time over the training time) say where the limit is.

Checkpoint and resume: every `train.checkpoint_every` steps (and once training ends) the head saves
its weights, its optimizer and the sample ids it trained on (vertical/checkpoint.py). Started again
with `resume` (the launcher does when its process died), it loads that checkpoint, reads the
towers' embeddings anew from the stream's start through fresh consumers (skipping the batches it
already holds) and trains batch `applied` on. The checkpoint is also on the queue's object
store, so the head resumes on another node as well (one that is not the queue's own). The
gradients of the batches it redoes go out again: the towers skip a batch whose gradient they already applied, and at the same weights the
same embeddings give the same gradient (bit for bit on one machine), so the run ends with the
weights of a run that was never interrupted. The batches the dead process trained after its last
checkpoint are dropped with it: counted once, in the process that resumed.

A tower with replicas (stages NAME.0 ... NAME.R-1, vertical/tower.py): each sends its share of a
batch (the rows it holds, data.owner_of); the head joins the shares in the batch's order into one
embedding and sends each replica the rows of the gradient that are its share.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from vpscluster import fsutil
from vpscluster.errors import UserError
from vpscluster.queue.client import InFlight
from vpscluster.vertical import checkpoint, data, wire
from vpscluster.vertical.spec import Spec, build_module, build_optimizer, loss_fn


def label_tensor(spec: Spec, values):
    import torch

    return torch.tensor(values, dtype=torch.long if spec.head.loss == "cross_entropy" else torch.float32)


def correct(spec: Spec, out, y) -> int | None:
    """How many predictions are right (None for a regression loss)."""
    if spec.head.loss == "cross_entropy":
        return int((out.argmax(-1) == y).sum())
    if spec.head.loss == "bce_with_logits":
        return int(((out > 0).float() == y).sum())
    return None


def _inboxes(spec: Spec, run_id: str, queue, ids: list[int], fresh: bool = False):
    """One inbox per tower stage (each replica's) and `join(phase, batch)` -> (embeddings in tower
    order, their messages, routes: per tower [(stage, rows of the batch or None: all, sample ids)],
    where each share's gradient goes). A tower with replicas sends each its share of the batch
    (data.owner_of): joined here in the batch's order. `fresh`: new consumers that read the stream
    from its start (a resumed head: the dead process's unacked messages would come again only
    after ack_wait, and its acked ones never)."""
    import torch

    K, timeout_s = spec.train.staleness, spec.train.timeout_s
    stream = wire.stream_name(run_id)
    queue.stream(stream, wire.subjects(run_id))
    by_tower = {t: [st for st in spec.stages() if wire.split_stage(st)[0] == t] for t in spec.towers}
    owners = {t: data.owner_of(ids, len(sts)) for t, sts in by_tower.items() if len(sts) > 1}
    stages = [st for sts in by_tower.values() for st in sts]
    if fresh:
        for st in stages:
            queue.delete_consumer(stream, f"head-{wire.token(st)}")
    inboxes = {st: wire.Inbox(queue.consume(wire.emb_subject(run_id, st), durable=f"head-{wire.token(st)}",
                                            max_pending=K + 1, ack_wait_s=max(30.0, timeout_s)),
                              timeout_s, f"head (from tower {st})") for st in stages}

    def take(st: str, phase: str, batch, want: tuple[int, ...]):
        tensor, meta, msg = inboxes[st].take(phase, batch.step)
        if meta["ids"] != want:
            raise UserError(f"head: tower {st} sent {phase} batch {batch.step} with other sample ids than the "
                            "schedule's; do all stages run the same spec and data?")
        return tensor, msg

    def join(phase: str, batch) -> tuple[list, list, list]:
        embs, msgs, routes = [], [], []
        for t, sts in by_tower.items():
            if len(sts) == 1:
                tensor, msg = take(sts[0], phase, batch, batch.ids)
                embs.append(tensor)
                msgs.append(msg)
                routes.append([(sts[0], None, batch.ids)])
                continue
            pieces, route = [], []
            for r, st in enumerate(sts):
                rows = [k for k, i in enumerate(batch.ids) if owners[t][i] == r]
                share = tuple(batch.ids[k] for k in rows)
                tensor, msg = take(st, phase, batch, share)
                idx = torch.tensor(rows, dtype=torch.long)
                pieces.append((idx, tensor))
                msgs.append(msg)
                route.append((st, idx, share))
            width = next(p for _, p in pieces).shape[1:]
            full = torch.empty((len(batch.ids), *width), dtype=torch.float32)
            for idx, piece in pieces:
                full.index_copy_(0, idx, piece)
            embs.append(full)
            routes.append(route)
        return embs, msgs, routes

    return inboxes, join


def _predict(spec: Spec, fusion, ids: list[int], labels: dict, run_id: str, out_dir: str, queue) -> dict:
    import torch

    _, join = _inboxes(spec, run_id, queue, ids)
    sched = data.schedule_for(spec, ids, train=False)
    fusion.eval()
    lines, right, labelled = [], 0, 0
    pending = InFlight(limit=8 * (len(spec.stages()) - 1), timeout_s=spec.train.timeout_s)
    with torch.no_grad():
        for batch in sched.eval_batches(sorted(ids)):
            embs, msgs, _ = join("eval", batch)
            out = fusion(*embs)
            pred = out.argmax(-1) if spec.head.loss == "cross_entropy" else (out > 0).long() \
                if spec.head.loss == "bce_with_logits" else out
            for i, p in zip(batch.ids, pred.tolist()):
                lines.append(json.dumps({spec.id_column: i, "prediction": p}) + "\n")
                if labels.get(i) is not None and spec.head.loss != "mse":
                    labelled += 1
                    right += int(p == labels[i])
            for m in msgs:
                pending.add(m.ack_nowait(), f"ack of eval batch {batch.step}")
    pending.wait()
    out_path = Path(out_dir) / "predictions.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_atomic(out_path, "".join(lines))
    report = {"rows": len(lines), "predictions": str(out_path), "accuracy": right / labelled if labelled else None}
    fsutil.write_json(Path(out_dir) / "report.json", report)
    return report


def run(spec: Spec, rows_file: str, run_id: str, out_dir: str, queue, say=print, weights: str | None = None,
        resume: bool = False) -> dict:
    """Train, then score the validation ids; with `weights` (a trained head's state) only predict
    every row (predictions.jsonl; accuracy where the rows carry labels). `resume`: go on from the
    head's checkpoint in `out_dir` (a process that died; see the module's doc)."""
    import torch

    rows = data.read_rows(rows_file)
    ids = data.check_ids(rows, spec.id_column)
    labels = {r[spec.id_column]: r.get(spec.head.label) for r in rows}
    fusion = build_module(spec, "head")
    opt = build_optimizer(spec, "head", fusion.parameters())
    loss_of = loss_fn(spec)
    if weights:
        fusion.load_state_dict(torch.load(weights, weights_only=True))
        return _predict(spec, fusion, ids, labels, run_id, out_dir, queue)
    sched = data.schedule_for(spec, ids)
    K, timeout_s = spec.train.staleness, spec.train.timeout_s
    towers = list(spec.towers)
    ckpt = checkpoint.path_of(out_dir, "head")
    store = checkpoint.Store(queue, run_id, timeout_s) if spec.train.checkpoint_every else None
    state = checkpoint.load(ckpt, store, "head") if resume else None
    start, counts, last_loss = 0, {}, None
    if state is not None:
        fusion.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, last_loss = int(state["applied"]), state["last_loss"]
        counts = {int(e): Counter({int(i): int(n) for i, n in c.items()}) for e, c in state["counts"].items()}
        say(f"head: resumed from its checkpoint after step {start}")
    every_ckpt = spec.train.checkpoint_every

    def save(applied: int) -> None:
        checkpoint.save(ckpt, fusion, opt, applied, store, "head", counts={e: dict(c) for e, c in counts.items()},
                        last_loss=losses[-1] if losses else last_loss)

    inboxes, join = _inboxes(spec, run_id, queue, ids, fresh=resume)
    # publishes and acks are confirmed off the critical path, at most this many unconfirmed at once
    pending = InFlight(limit=4 * (K + 2) * len(inboxes), timeout_s=timeout_s)

    losses: list[float] = []
    grad_bytes = 0
    t0 = t_first = time.monotonic()
    every = max(1, sched.steps // 10)
    said = t0
    waited = 0.0  # time the head waited for the towers' embeddings (after the first batch)
    trained = 0  # samples this process trained on
    cpu_first = time.process_time()
    for batch in sched.train_batches():
        if batch.step < start:
            continue
        t_ask = time.monotonic()
        embs, msgs, routes = join("train", batch)
        trained += len(batch.ids)
        if batch.step == start:
            t_first = time.monotonic()  # the towers' start-up is not throughput
            cpu_first = time.process_time()
        else:
            waited += time.monotonic() - t_ask
        counts.setdefault(batch.epoch, Counter()).update(batch.ids)
        leaves = [e.requires_grad_(True) for e in embs]
        loss = loss_of(fusion(*leaves), label_tensor(spec, [labels[i] for i in batch.ids]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for route, leaf in zip(routes, leaves):
            for st, idx, share in route:
                grad = leaf.grad if idx is None else leaf.grad.index_select(0, idx)
                payload, headers = wire.encode(grad, batch.step, batch.epoch, "train", share)
                pending.add(queue.publish_nowait(wire.grad_subject(run_id, st), payload, headers, timeout_s=timeout_s),
                            f"publish of tower {st}'s gradient {batch.step}")
                grad_bytes += wire.message_bytes(payload, headers)
        for m in msgs:
            pending.add(m.ack_nowait(timeout_s), f"ack of train batch {batch.step}")
        losses.append(float(loss.detach()))
        if every_ckpt and (batch.step + 1) % every_ckpt == 0:
            save(batch.step + 1)
        if (batch.step + 1) % every == 0 or batch.step + 1 == sched.steps or time.monotonic() - said > 10.0:
            said = time.monotonic()
            say(f"step {batch.step + 1}/{sched.steps} epoch {batch.epoch} loss {losses[-1]:.4f}")
    pending.wait()
    train_s = time.monotonic() - t_first
    train_cpu_s = time.process_time() - cpu_first if sched.steps > start else 0.0
    if sched.steps > start and every_ckpt:
        save(sched.steps)  # dying while it scores the validation batches resumes there
    if store is not None:
        store.wait()
    train_bytes = sum(i.bytes for i in inboxes.values()) + grad_bytes

    fusion.eval()
    right = seen = 0
    val_loss = 0.0
    with torch.no_grad():
        for batch in sched.eval_batches(sched.val_ids):
            embs, msgs, _ = join("eval", batch)
            y = label_tensor(spec, [labels[i] for i in batch.ids])
            out = fusion(*embs)
            val_loss += float(loss_of(out, y)) * len(batch.ids)
            c = correct(spec, out, y)
            right += c or 0
            seen += len(batch.ids)
            for m in msgs:
                pending.add(m.ack_nowait(timeout_s), f"ack of eval batch {batch.step}")
    pending.wait()

    epochs = []
    scheduled: dict[int, list[int]] = {}
    for b in sched.train_batches():
        scheduled.setdefault(b.epoch, []).extend(b.ids)
    for e, want in scheduled.items():
        got = counts.get(e, Counter())
        epochs.append({"epoch": e, "samples": sum(got.values()), "unique": len(got), "expected": len(want),
                       "exactly_once": sorted(got) == sorted(want) and all(v == 1 for v in got.values())})
    samples = sum(len(b.ids) for b in sched.train_batches())
    report = {
        "towers": towers, "replicas": {t: spec.towers[t].n_replicas for t in towers}, "staleness": K,
        "steps": sched.steps, "batch_size": spec.train.batch_size,
        "samples": samples, "epochs": epochs, "exactly_once": all(e["exactly_once"] for e in epochs),
        "final_train_loss": losses[-1] if losses else last_loss,
        "head_resumed_from": start if state is not None else None,
        "val_samples": seen, "val_loss": val_loss / seen if seen else None,
        "val_accuracy": right / seen if seen and spec.head.loss != "mse" else None,
        "train_seconds": train_s, "wall_seconds": time.monotonic() - t0,
        "samples_per_s": trained / train_s if train_s > 0 and trained else None,  # this process's
        # the share of the training time the head waited on the towers (the rest: its own work);
        # near 1 the towers or the queue limit, near 0 the head does
        "head_wait_share": waited / train_s if train_s > 0 else None,
        "head_cpu_share": train_cpu_s / train_s if train_s > 0 else None,  # its CPU time (all threads) / wall
        "queue_bytes": train_bytes, "bytes_per_sample": train_bytes / trained if trained else None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(fusion.state_dict(), out / "head.pt")
    fsutil.write_json(out / "report.json", report)
    return report
