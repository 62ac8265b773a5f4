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
"""

from __future__ import annotations

import time
from pathlib import Path

from vpscluster.queue.client import InFlight
from vpscluster.vertical import checkpoint, data, wire
from vpscluster.vertical.spec import Spec, build_module, build_optimizer, featurize


def run(spec: Spec, name: str, rows_file: str, run_id: str, out_dir: str, queue, say=print,
        weights: str | None = None, resume: bool = False) -> dict:
    """Train (then send the validation batches), or with `weights` (a trained tower's state) only
    send every row's embeddings (predict). `resume`: go on from this tower's checkpoint in
    `out_dir` (a process that died): the batches after it are run forward again; the head skips
    the embeddings it already used, and their gradients, still in the stream, are applied again
    from a fresh consumer that reads the subject from its start."""
    import torch
    from torch.func import functional_call

    rows = data.read_rows(rows_file)
    ids = data.check_ids(rows, spec.id_column)
    pos = {i: k for k, i in enumerate(ids)}
    features = featurize(spec, name, rows)
    model = build_module(spec, name)
    opt = build_optimizer(spec, name, model.parameters())
    if weights:
        model.load_state_dict(torch.load(weights, weights_only=True))
    sched = data.schedule_for(spec, ids, train=weights is None)
    K, timeout_s = spec.train.staleness, spec.train.timeout_s

    start = 0
    ckpt = checkpoint.path_of(out_dir, name)
    state = checkpoint.load(ckpt) if resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["applied"])
        say(f"tower {name}: resumed from its checkpoint after step {start}")
    queue.stream(wire.stream_name(run_id), wire.subjects(run_id))
    if resume:  # the dead process's unacked gradients would come again only after ack_wait: read them anew
        queue.delete_consumer(wire.stream_name(run_id), f"tower-{name}")
    grads = wire.Inbox(queue.consume(wire.grad_subject(run_id, name), durable=f"tower-{name}", max_pending=K + 1,
                                     ack_wait_s=max(30.0, timeout_s)), timeout_s, f"tower {name}")
    emb_subject = wire.emb_subject(run_id, name)
    # publishes and acks are confirmed off the critical path, at most this many unconfirmed at once
    pending = InFlight(limit=4 * (K + 2), timeout_s=timeout_s)
    in_flight: dict[int, tuple[dict, torch.Tensor]] = {}
    every = spec.train.checkpoint_every

    def inputs(ids_):
        idx = torch.tensor([pos[i] for i in ids_])
        return tuple(f[idx] for f in features)

    def apply_oldest() -> None:
        step = min(in_flight)
        grad, _, msg = grads.take("train", step)
        stash, emb = in_flight.pop(step)
        emb.backward(grad)
        for n, p in model.named_parameters():
            p.grad = stash[n].grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        if every and (step + 1) % every == 0:
            checkpoint.save(ckpt, model, opt, step + 1)
        pending.add(msg.ack_nowait(timeout_s), f"ack of gradient {step}")

    t0 = time.monotonic()
    sent = 0
    for batch in sched.train_batches():
        if batch.step < start:
            continue
        while in_flight and min(in_flight) < batch.step - K:
            apply_oldest()
        stash = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
        emb = functional_call(model, stash, inputs(batch.ids))
        in_flight[batch.step] = (stash, emb)
        payload, headers = wire.encode(emb, batch.step, batch.epoch, "train", batch.ids)
        pending.add(queue.publish_nowait(emb_subject, payload, headers, timeout_s=timeout_s), f"publish of batch {batch.step}")
        sent += wire.message_bytes(payload, headers)
    while in_flight:
        apply_oldest()

    model.eval()
    with torch.no_grad():
        for batch in sched.eval_batches(sched.val_ids if weights is None else sorted(ids)):
            payload, headers = wire.encode(model(*inputs(batch.ids)), batch.step, -1, "eval", batch.ids)
            pending.add(queue.publish_nowait(emb_subject, payload, headers, timeout_s=timeout_s),
                        f"publish of eval batch {batch.step}")
            sent += wire.message_bytes(payload, headers)
    pending.wait()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if weights is None:
        torch.save(model.state_dict(), out / f"tower-{name}.pt")
    say(f"tower {name}: {sched.steps} steps in {time.monotonic() - t0:.1f} s")
    return {"tower": name, "steps": sched.steps, "bytes_sent": sent, "bytes_received": grads.bytes}
