"""What travels on the queue between the stages of a vertical split: subjects, tensors, batch ids.

One JetStream stream per run, `vt_<run>` on `vt.<run>.>`, stored on the queue server's disk:

    vt.<run>.emb.<stage>    a tower's embeddings of one batch      (tower -> head)
    vt.<run>.grad.<stage>   the loss's gradient w.r.t. them         (head -> tower)
    vt.<run>.sync.<stage>   a replica's weight gradient of a batch  (replica -> the tower's other replicas)

A stage is a tower's name, or `NAME-rN` for replica N of a tower that has several.

A message is the tensor's raw bytes (float32, C order); its headers say which batch it is
(`step`, `epoch`, `phase`: train | eval), which samples (`ids`, comma-separated) and the shape.
Each consumer is durable with explicit acks and at most K + 1 unacked messages (backpressure).
Its messages are pulled in the background (`Consumer.prefetch`), and publishes and acks are
confirmed off the critical path (`queue.client.InFlight`): a stage waits on the queue only for a
message it needs and has not got, never for a round trip it could overlap with compute.
"""

from __future__ import annotations

from typing import Any


def stream_name(run: str) -> str:
    return f"vt_{run}"


def subjects(run: str) -> list[str]:
    return [f"vt.{run}.>"]


def split_stage(stage: str) -> tuple[str, int | None]:
    """`image.1` -> ("image", 1); `text` -> ("text", None)."""
    name, dot, r = stage.partition(".")
    return (name, int(r)) if dot else (name, None)


def token(stage: str) -> str:
    """A stage as one queue token (subjects' parts and durable names hold no dots): `image.1` -> `image-r1`."""
    name, r = split_stage(stage)
    return name if r is None else f"{name}-r{r}"


def emb_subject(run: str, stage: str) -> str:
    return f"vt.{run}.emb.{token(stage)}"


def grad_subject(run: str, stage: str) -> str:
    return f"vt.{run}.grad.{token(stage)}"


def sync_subject(run: str, stage: str) -> str:
    return f"vt.{run}.sync.{token(stage)}"


def encode(tensor, step: int, epoch: int, phase: str, ids) -> tuple[bytes, dict[str, str]]:
    import torch

    t = tensor.detach().to(torch.float32).contiguous().cpu()
    headers = {"step": str(step), "epoch": str(epoch), "phase": phase, "ids": ",".join(map(str, ids)),
               "shape": "x".join(map(str, t.shape))}
    return t.numpy().tobytes(), headers


def decode(data: bytes, headers: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """(tensor, {"step", "epoch", "phase", "ids"}) of a message `encode` made."""
    import numpy as np
    import torch

    shape = tuple(int(x) for x in headers["shape"].split("x") if x)
    t = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(shape)
    ids = tuple(int(x) for x in headers["ids"].split(",")) if headers.get("ids") else ()
    return t, {"step": int(headers["step"]), "epoch": int(headers["epoch"]), "phase": headers["phase"], "ids": ids}


def message_bytes(data: bytes, headers: dict[str, str]) -> int:
    """What one message carries (payload and headers), for bytes per sample."""
    return len(data) + sum(len(k) + len(v) + 4 for k, v in headers.items())


class Inbox:
    """One subject's messages in step order, each waited for at most `timeout_s`.

    One producer publishes a subject in order; a message delivered again (its ack was lost) or one
    of an earlier step is acknowledged and skipped, so a step is handed out once."""

    def __init__(self, consumer, timeout_s: float, what: str):
        self.consumer, self.timeout_s, self.what = consumer, timeout_s, what
        consumer.prefetch()
        self._held: dict[tuple[str, int], tuple[Any, dict[str, Any], Any]] = {}
        self.bytes = 0

    def take(self, phase: str, step: int):
        """(tensor, meta, message) of `phase`'s `step`; ack the message once it is used."""
        import time

        from vpscluster.errors import UserError

        deadline = time.monotonic() + self.timeout_s
        while (phase, step) not in self._held:
            left = deadline - time.monotonic()
            if left <= 0:
                err = getattr(self.consumer, "pump_error", None)
                raise UserError(f"{self.what}: no {phase} batch {step} within {self.timeout_s:g} s; is the stage that "
                                "sends it running? (its log says why not; train.timeout_s sets the wait)"
                                + (f"; the queue said: {err}" if err else ""))
            for m in self.consumer.fetch(64, timeout_s=min(left, 5.0)):
                tensor, meta = decode(m.data, m.headers)
                key = (meta["phase"], meta["step"])
                if key in self._held or (meta["phase"] == phase and meta["step"] < step):
                    m.ack()  # a second delivery of what was already used
                    continue
                self.bytes += message_bytes(m.data, m.headers)
                self._held[key] = (tensor, meta, m)
        return self._held.pop((phase, step))
