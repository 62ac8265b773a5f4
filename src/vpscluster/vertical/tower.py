"""A tower stage: forward its own columns, publish the embeddings, step on the gradients that come back.

Pipelining with bounded staleness K (PipeDream's weight stashing, Narayanan et al., SOSP 2019):
batch b is run forward once the gradients of every batch up to b - K - 1 are applied, so at most
K + 1 batches are in flight. Each in-flight batch keeps the weights it was run with (a copy,
through `torch.func.functional_call`), and its gradient is taken with those weights, then applied
to the current ones. K = 0 is exactly synchronous: the copy equals the weights, and the steps are
those of one process training the whole model on the same batches.

Nothing on the queue is waited for in the critical path unless it is needed: the gradients are
pulled in the background (wire.Inbox), and the embeddings' publishes and the gradients' acks are
confirmed later (queue.client.InFlight), so with K >= 1 the forward of the next batches overlaps
the head's work and the round trips of the batches in flight.

Replicas (a tower on R nodes, `replica` r of R): this process holds the rows of its share of the
samples (data.owner_of) and the list of every id, so it follows the same schedule as every stage
and runs forward on its share of each batch. The head sends back the gradient of those rows; the
weight gradient of the share goes on the tower's sync subject, and every replica adds the R
shares' in replica order (the same float operations everywhere, so the replicas' weights stay
equal bit for bit) before its optimizer steps. The loss is the head's mean over the whole batch,
so that sum is the whole batch's gradient: at K = 0 the weights are the one-process model's
(within float rounding: the sum is taken in another order). A replica resumed from its checkpoint
reads the others' shares anew, as it does its gradients.

Its checkpoint goes to this node's disk and to the queue's object store (vertical/checkpoint.py):
started on another node after its own is gone, it resumes from the queue's copy.
"""

from __future__ import annotations

import time
from pathlib import Path

from vpscluster.errors import UserError
from vpscluster.queue.client import InFlight
from vpscluster.vertical import checkpoint, data, wire
from vpscluster.vertical.spec import Spec, build_module, build_optimizer, featurize


def run(spec: Spec, name: str, rows_file: str, run_id: str, out_dir: str, queue, say=print,
        weights: str | None = None, resume: bool = False, replica: int | None = None,
        ids_file: str | None = None) -> dict:
    """Train (then send the validation batches), or with `weights` (a trained tower's state) only
    send every row's embeddings (predict). `resume`: go on from this tower's checkpoint in
    `out_dir` (a process that died): the batches after it are run forward again; the head skips
    the embeddings it already used, and their gradients, still in the stream, are applied again
    from a fresh consumer that reads the subject from its start. `replica` (of a tower with
    several): this process's index; `ids_file` then lists every sample id (`rows_file` holds its
    share of the rows only)."""
    import torch
    from torch.func import functional_call

    R = spec.towers[name].n_replicas
    if (replica is None) != (R == 1) or (replica is not None and not 0 <= replica < R) or (R > 1 and not ids_file):
        raise UserError(f"tower {name}: has {R} replica(s); start replica r of them with --replica r (0..{R - 1}) "
                        "and --ids FILE" if R > 1 else f"tower {name}: has one replica; leave out --replica")
    stage = name if replica is None else f"{name}.{replica}"
    rows = data.read_rows(rows_file)
    own = data.check_ids(rows, spec.id_column)
    ids = data.read_ids(ids_file) if ids_file else own
    pos = {i: k for k, i in enumerate(own)}
    features = featurize(spec, name, rows)
    model = build_module(spec, name)
    opt = build_optimizer(spec, name, model.parameters())
    if weights:
        model.load_state_dict(torch.load(weights, weights_only=True))
    sched = data.schedule_for(spec, ids, train=weights is None)
    K, timeout_s = spec.train.staleness, spec.train.timeout_s

    start = 0
    ckpt = checkpoint.path_of(out_dir, name)
    store = checkpoint.Store(queue, run_id, timeout_s) if spec.train.checkpoint_every and weights is None else None
    state = checkpoint.load(ckpt, store, stage) if resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["applied"])
        say(f"tower {stage}: resumed from its checkpoint after step {start}")
    stream = wire.stream_name(run_id)
    queue.stream(stream, wire.subjects(run_id))
    me = wire.token(stage)
    peers = [f"{name}.{q}" for q in range(R) if q != replica] if R > 1 else []
    if resume:  # the dead process's unacked messages would come again only after ack_wait: read them anew
        for durable in [f"tower-{me}", *(f"sync-{me}-from-{wire.token(p)}" for p in peers)]:
            queue.delete_consumer(stream, durable)
    ack_wait_s = max(30.0, timeout_s)
    grads = wire.Inbox(queue.consume(wire.grad_subject(run_id, stage), durable=f"tower-{me}", max_pending=K + 1,
                                     ack_wait_s=ack_wait_s), timeout_s, f"tower {stage}")
    shares = {p: wire.Inbox(queue.consume(wire.sync_subject(run_id, p), durable=f"sync-{me}-from-{wire.token(p)}",
                                          max_pending=K + 2, ack_wait_s=ack_wait_s), timeout_s,
                            f"tower {stage} (the weight gradients of replica {p})") for p in peers}
    emb_subject = wire.emb_subject(run_id, stage)
    # publishes and acks are confirmed off the critical path, at most this many unconfirmed at once
    pending = InFlight(limit=4 * (K + 2) * R, timeout_s=timeout_s)
    in_flight: dict[int, tuple[dict, torch.Tensor]] = {}
    every = spec.train.checkpoint_every
    sent = 0

    def inputs(ids_):
        idx = torch.tensor([pos[i] for i in ids_], dtype=torch.long)
        return tuple(f[idx] for f in features)

    def mine(batch) -> tuple[int, ...]:
        return batch.ids if R == 1 else tuple(i for i in batch.ids if i in pos)

    def sum_over_replicas(step: int, stash: dict) -> None:
        """Every replica's weight gradient of `step`, added in replica order, into the stash's grads."""
        nonlocal sent
        names = [n for n, _ in model.named_parameters()]
        own_flat = torch.cat([(stash[n].grad if stash[n].grad is not None else torch.zeros_like(stash[n])).reshape(-1)
                              for n in names]).to(torch.float32)
        payload, headers = wire.encode(own_flat, step, -1, "sync", ())
        pending.add(queue.publish_nowait(wire.sync_subject(run_id, stage), payload, headers, timeout_s=timeout_s),
                    f"publish of the weight gradient {step}")
        sent += wire.message_bytes(payload, headers)
        parts = {replica: own_flat}
        for p, inbox in shares.items():
            flat, _, msg = inbox.take("sync", step)
            parts[wire.split_stage(p)[1]] = flat
            pending.add(msg.ack_nowait(timeout_s), f"ack of replica {p}'s weight gradient {step}")
        total = parts[0].clone()
        for q in range(1, R):
            total += parts[q]
        offset = 0
        for n in names:
            k = stash[n].numel()
            stash[n].grad = total[offset:offset + k].view_as(stash[n]).clone()
            offset += k

    def apply_oldest() -> None:
        step = min(in_flight)
        grad, _, msg = grads.take("train", step)
        stash, emb = in_flight.pop(step)
        emb.backward(grad)
        if R > 1:
            sum_over_replicas(step, stash)
        for n, p in model.named_parameters():
            p.grad = stash[n].grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        if every and (step + 1) % every == 0:
            checkpoint.save(ckpt, model, opt, step + 1, store, stage)
        pending.add(msg.ack_nowait(timeout_s), f"ack of gradient {step}")

    t0 = time.monotonic()
    for batch in sched.train_batches():
        if batch.step < start:
            continue
        while in_flight and min(in_flight) < batch.step - K:
            apply_oldest()
        share = mine(batch)
        stash = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
        emb = functional_call(model, stash, inputs(share))
        in_flight[batch.step] = (stash, emb)
        payload, headers = wire.encode(emb, batch.step, batch.epoch, "train", share)
        pending.add(queue.publish_nowait(emb_subject, payload, headers, timeout_s=timeout_s), f"publish of batch {batch.step}")
        sent += wire.message_bytes(payload, headers)
    while in_flight:
        apply_oldest()

    model.eval()
    with torch.no_grad():
        for batch in sched.eval_batches(sched.val_ids if weights is None else sorted(ids)):
            share = mine(batch)
            payload, headers = wire.encode(model(*inputs(share)), batch.step, -1, "eval", share)
            pending.add(queue.publish_nowait(emb_subject, payload, headers, timeout_s=timeout_s),
                        f"publish of eval batch {batch.step}")
            sent += wire.message_bytes(payload, headers)
    pending.wait()
    if store is not None:
        store.wait()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if weights is None:
        torch.save(model.state_dict(), out / f"tower-{name}.pt")
    say(f"tower {stage}: {sched.steps} steps in {time.monotonic() - t0:.1f} s")
    return {"tower": name, "stage": stage, "steps": sched.steps, "bytes_sent": sent,
            "bytes_received": grads.bytes + sum(i.bytes for i in shares.values())}
