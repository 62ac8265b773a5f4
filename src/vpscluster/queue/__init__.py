"""The message queue: NATS JetStream on the head (`vpscluster queue up`) or a server of the user's own.

    from vpscluster import queue
    q = queue.connect(cluster)          # or queue.connect() in a process a launch gave VPSC_QUEUE_*
    q.stream("acts", ["acts.>"]); q.publish("acts.text", b"...", {"batch": "7"})
    for m in q.consume("acts.text", durable="head", max_pending=8).fetch(4, timeout_s=5): m.ack()

client.py   the synchronous interface (time-outs on every call; nats-py's asyncio hidden)
server.py   up / down / status of nats-server on the head, its config, the record and the token
"""

from __future__ import annotations

from vpscluster.queue.client import Consumer, Credentials, Message, Queue, QueueError, connect

__all__ = ["Consumer", "Credentials", "Message", "Queue", "QueueError", "connect"]
