"""The queue without a server: the nats-server configuration `queue up` writes (a snapshot), the
exporter's metrics from nats-server's monitoring JSON (a snapshot), the cluster file's `queue:`
key, the network-safety refusals, the token file, and the client's time-outs.

Regenerate the snapshot after an intended change: VPSC_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/test_queue_units.py
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from snapshot_check import check_snapshot

VARZ = {"in_msgs": 12, "in_bytes": 3400, "out_msgs": 9, "out_bytes": 2100}
JSZ = {"account_details": [{"name": "$G", "stream_detail": [{
    "name": "acts", "state": {"messages": 7, "bytes": 700, "first_seq": 1, "last_seq": 7},
    "consumer_detail": [{"name": "head", "num_pending": 3, "num_ack_pending": 2, "num_redelivered": 1,
                         "delivered": {"consumer_seq": 6, "stream_seq": 5},
                         "ack_floor": {"consumer_seq": 2, "stream_seq": 2}}],
}]}]}


def _cluster_file(tmp_path: Path, host: str = "10.0.0.5", **extra) -> Path:
    doc = {"nodes": [{"name": "a", "host": host}, {"name": "b", "host": host.rsplit(".", 1)[0] + ".6"}], **extra}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_generated_config_and_metrics_snapshot():
    from vpscluster.nodeside.queue_exporter import render
    from vpscluster.queue.server import QueueRecord, nats_config, queue_targets

    conf = nats_config("10.77.0.1", 4222, 8222, "/srv/vpsc/queue", "TOKEN", max_store=2 * 10**9)
    rec = QueueRecord(head="a", url="nats://10.77.0.1:4222", address="10.77.0.1", port=4222,
                      monitor_url="http://10.77.0.1:8222", metrics_url="http://10.77.0.1:9472/metrics",
                      queue_dir="/srv/vpsc/queue", nats_pid=1, exporter_pid=2)
    check_snapshot("queue_generated.json", {
        "nats.conf": conf,
        "nats.conf ipv6": nats_config("fd00::1", 4222, 8222, "/q", "T"),
        "targets/queue.json": queue_targets(rec),
        "metrics": render(VARZ, JSZ).splitlines(),
        "metrics, server down": render(None, None).splitlines(),
    })
    # what the snapshot must hold whatever it says: one address, a token, a bounded store on disk
    assert conf["host"] == "10.77.0.1" and conf["http"] == "10.77.0.1:8222"
    assert conf["authorization"] == {"token": "TOKEN"}
    assert conf["jetstream"]["store_dir"] == "/srv/vpsc/queue/store" and conf["jetstream"]["max_file_store"] == 2 * 10**9


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_config_refuses_every_interface(address):
    from vpscluster.errors import UserError
    from vpscluster.queue.server import nats_config

    with pytest.raises(UserError, match="every interface"):
        nats_config(address, 4222, 8222, "/q", "T")


def test_up_refuses_public_addresses_without_the_overlay(tmp_path):
    path = _cluster_file(tmp_path, host="203.0.113.10")
    r = run_cli("queue", "up", "--cluster", str(path), timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "refusing to launch over public addresses" in r.stderr
    assert "NATS" in r.stderr and "provision" in r.stderr


def test_cluster_file_queue_key(tmp_path):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.errors import UserError
    from vpscluster.queue.server import credentials

    token = tmp_path / "nats.token"
    token.write_text("s3cret\n")
    c = load_cluster(_cluster_file(tmp_path, queue={"url": "nats://10.0.0.9:4222", "token_file": "nats.token"}))
    assert c.queue.url == "nats://10.0.0.9:4222" and c.queue.token_file == str(token)
    creds = credentials(c)
    assert (creds.url, creds.token) == ("nats://10.0.0.9:4222", "s3cret")
    assert creds.env() == {"VPSC_QUEUE_URL": "nats://10.0.0.9:4222", "VPSC_QUEUE_TOKEN": "s3cret"}

    for bad, message in (({"url": "http://10.0.0.9"}, "is not a NATS server URL"),
                         ({"url": "nats://u:p@10.0.0.9"}, "is not a NATS server URL"),
                         ({"token_file": "nats.token"}, "queue: no url"),
                         ({"url": "nats://10.0.0.9", "token_file": "missing.token"}, "does not exist"),
                         ({"url": "nats://10.0.0.9", "user": "u"}, "user and password_file go together"),
                         ({"url": "nats://10.0.0.9", "token_file": "nats.token", "user": "u", "password_file": "nats.token"},
                          "not both")):
        with pytest.raises(UserError, match=message):
            load_cluster(_cluster_file(tmp_path, queue=bad))

    # a server of the user's own: `queue up` starts none; a public one must be tls:// (or the overlay / opt-in)
    r = run_cli("queue", "up", "--cluster", str(_cluster_file(tmp_path, queue={"url": "nats://10.0.0.9:4222"})), timeout=60)
    assert r.returncode != 0 and "names a server of its own" in r.stderr
    public = load_cluster(_cluster_file(tmp_path, queue={"url": "nats://198.51.100.7:4222", "token_file": "nats.token"}))
    with pytest.raises(UserError, match="refusing nats://198.51.100.7:4222: a public address"):
        credentials(public)
    for ok in ({"url": "tls://198.51.100.7:4222", "token_file": "nats.token"},):
        assert credentials(load_cluster(_cluster_file(tmp_path, queue=ok))).url == ok["url"]
    opted = load_cluster(_cluster_file(tmp_path, insecure_network=True,
                                       queue={"url": "nats://198.51.100.7:4222", "token_file": "nats.token"}))
    assert credentials(opted).token == "s3cret"


def test_token_is_made_once_and_kept_0600(tmp_path):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.queue import server

    c = load_cluster(_cluster_file(tmp_path))
    first = server._token(c)
    path = server.token_path(c)
    assert path.parent == tmp_path / ".vpscluster" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server._token(c) == first and len(first) >= 32
    path.chmod(0o644)
    assert server._token(c) == first and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_every_call_has_a_time_out():
    """A server that accepts but never speaks: connect gives up in its time-out with one line."""
    from vpscluster.errors import UserError
    from vpscluster.queue import Credentials, QueueError, connect

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"nats://127.0.0.1:{mute.getsockname()[1]}"
        t = time.monotonic()
        with pytest.raises(QueueError, match="did not finish within|failed"):
            connect(creds=Credentials(url, token="x"), timeout_s=1.0)
        assert time.monotonic() - t < 10
    with pytest.raises(UserError, match="no server known"):
        connect()


def test_exporter_names_are_the_telemetry_contract():
    """The exporter imports no vpscluster (it runs from its source on the head): its names and kinds
    must still be telemetry.QUEUE_METRICS', which `top` queries."""
    from vpscluster import telemetry as T
    from vpscluster.nodeside.queue_exporter import render

    served = {ln.split()[2]: ln.split()[3] for ln in render(VARZ, JSZ).splitlines() if ln.startswith("# TYPE")}
    assert served == {m.sample: m.kind for m in T.QUEUE_METRICS}
