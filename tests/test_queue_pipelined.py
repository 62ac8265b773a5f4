"""The queue client's pipelined calls on a real nats-server (a private one on loopback): publishes
and acks sent without waiting and confirmed through InFlight, a consumer pulling in the
background (prefetch) that still holds to max_pending, and a failure that reaches the caller."""

from __future__ import annotations

import shutil

import pytest

from vpscluster.queue.client import InFlight, Queue, QueueError
from vpscluster.queue.server import serve_private

pytestmark = pytest.mark.skipif(shutil.which("nats-server") is None, reason="no nats-server (apt install nats-server)")


@pytest.fixture(scope="module")
def q(tmp_path_factory):
    with serve_private(tmp_path_factory.mktemp("queue")) as srv:
        queue = Queue(srv.creds, timeout_s=5.0)
        queue.stream("p", ["p.>"])
        try:
            yield queue
        finally:
            queue.close()


def test_nowait_publishes_and_acks_arrive_in_order_and_are_confirmed(q):
    sent = InFlight(limit=8, timeout_s=5.0)
    for i in range(50):
        sent.add(q.publish_nowait("p.order", str(i).encode(), {"i": str(i)}), f"publish {i}")
        assert len(sent) <= 8  # the window holds: adding a ninth waited for the oldest
    sent.wait()
    c = q.consume("p.order", durable="order", max_pending=64)
    c.prefetch()
    got = []
    while len(got) < 50:
        batch = c.fetch(64, timeout_s=5.0)
        assert batch, f"only {len(got)} of 50 came"
        got += batch
    assert [m.data for m in got] == [str(i).encode() for i in range(50)]
    acks = InFlight(limit=16, timeout_s=5.0)
    for m in got:
        acks.add(m.ack_nowait(), f"ack {m.headers['i']}")
    acks.wait()
    info = c.info()
    assert info["num_ack_pending"] == 0 and info["ack_floor"] == got[-1].stream_seq


def test_the_background_pull_holds_to_max_pending(q):
    for i in range(5):
        q.publish("p.held", str(i).encode())
    c = q.consume("p.held", durable="held", max_pending=2)
    c.prefetch()
    first = c.fetch(10, timeout_s=5.0)
    first += c.fetch(10, timeout_s=1.0) if len(first) < 2 else []
    assert [m.data for m in first] == [b"0", b"1"]
    assert c.fetch(10, timeout_s=1.0) == []  # two unacked: the server hands out no third
    first[0].ack()
    assert [m.data for m in c.fetch(10, timeout_s=5.0)] == [b"2"]


def test_a_failed_nowait_publish_is_raised_as_one_line(q):
    sent = InFlight(limit=4, timeout_s=2.0)
    sent.add(q.publish_nowait("nostream.x", b"lost", timeout_s=2.0), "publish to nostream.x")
    with pytest.raises(QueueError) as e:
        sent.wait()
    assert "publish to nostream.x" in str(e.value) and "\n" not in str(e.value)
