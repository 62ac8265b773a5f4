"""The TCP link tool on loopback: parallel streams, clock offset, errors, and a server that
never outlives its idle time-out. (Rates against shaped links and iperf3: test_probe_sandbox.)"""

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from vpscluster import nodeside
from vpscluster.nodeside import links
from vpscluster.nodeside import parse_json_output


@pytest.fixture
def server():
    proc = subprocess.Popen(nodeside.command(sys.executable, "links", "server", "--bind", "127.0.0.1",
                                           "--idle-timeout-s", "3"), stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("LISTENING ")
        yield proc, int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(timeout=10)


def client(port, *args):
    out = subprocess.run(nodeside.command(sys.executable, "links", "client", "--peer", f"127.0.0.1:{port}", *args),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return parse_json_output(out.stdout)


def test_rtt_and_parallel_streams(server):
    proc, port = server
    one = client(port, "--duration-s", "0.5", "--warmup-s", "0.1", "--rtt-samples", "15")
    assert one["streams"] == 1 and one["bandwidth_mbit"] > 50 and one["rtt_samples"] == 15
    assert 0 < one["rtt_ms_min"] <= one["rtt_ms"] <= one["rtt_ms_p95"] < 50
    assert abs(one["clock_offset_s"]) < 0.01  # same clock
    three = client(port, "--duration-s", "0.5", "--warmup-s", "0.1", "--streams", "3", "--rtt-samples", "0")
    assert three["streams"] == 3 and three["bandwidth_mbit"] > 50 and "rtt_ms" not in three
    # The server counted every byte it reported: 3 windows of ~0.5 s each.
    assert three["bytes"] > 0 and 0.45 <= three["seconds"] < 2


def test_server_exits_when_idle(server):
    proc, port = server
    client(port, "--duration-s", "0", "--rtt-samples", "3")
    assert proc.wait(timeout=15) == 0  # idle time-out 3 s after the last connection


def test_closed_port_is_an_error_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        start = time.monotonic()
        out = client(port, "--duration-s", "1", "--timeout-s", "2")
    assert "error" in out and str(port) in out["error"] and time.monotonic() - start < 10


def test_clock_offset_is_server_time_minus_midpoint():
    # A ping server whose clock runs 5 s ahead and that answers after 20 ms.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            while not conn.recv(1).endswith(b"\n"):
                pass
            while conn.recv(1):
                time.sleep(0.010)
                stamp = time.time() + 5.0
                time.sleep(0.010)
                conn.sendall(struct.pack("!d", stamp))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        r = links.measure_rtt("127.0.0.1", srv.getsockname()[1], samples=5, timeout_s=5)
    finally:
        srv.close()
    assert r["rtt_ms_min"] >= 20
    assert r["clock_offset_s"] == pytest.approx(5.0, abs=0.005)
    assert r["clock_uncertainty_s"] == pytest.approx(r["rtt_ms_min"] / 2000)


def test_script_runs_from_its_bootstrap_with_only_the_standard_library(tmp_path):
    # What the nodes run: the source inside `python -c`, here with -S (no site-packages at all).
    cmd = nodeside.command(sys.executable, "facts", json.dumps({"workdir": str(tmp_path), "disk_bytes": 1 << 20}))
    out = subprocess.run([cmd[0], "-S", *cmd[1:]], capture_output=True, text=True, timeout=60)
    facts = parse_json_output(out.stdout)
    assert out.returncode == 0 and facts["torch"] is None and "ModuleNotFoundError" in facts["torch_error"]
    assert facts["disk_read_mb_s"] > 0 and facts["disk_free_bytes"] > 0 and list(tmp_path.iterdir()) == []
    assert facts["cpu_count"] >= 1 and facts["memory_bytes"] > 0 and facts["python"] == ".".join(map(str, sys.version_info[:3]))


def test_the_server_binds_the_address_given_and_falls_back_where_it_is_not_its_own():
    """The probe started every link server on 0.0.0.0; now on the node's address. Behind a
    provider's 1:1 NAT that address is not on the node: the server still starts (every interface)."""
    for bind, want in (("127.0.0.1", "127.0.0.1"), ("203.0.113.10", "0.0.0.0")):
        proc = subprocess.Popen(nodeside.command(sys.executable, "links", "server", "--bind", bind,
                                                 "--idle-timeout-s", "5"), stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line.startswith("LISTENING "), line
            port = int(line.split()[1])
            out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=30).stdout
            assert f"{want}:{port}" in out, out
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_warmup_outlasts_slow_start_on_a_long_round_trip():
    # A LAN keeps the asked warm-up; a 50 ms WAN link gets 12 round trips of slow start; capped.
    assert links.warmup_for(0.2, 0.08) == 0.2
    assert links.warmup_for(0.2, None) == 0.2
    assert links.warmup_for(0.2, 50.0) == pytest.approx(0.6)
    assert links.warmup_for(0.5, 50.0) == pytest.approx(0.6)
    assert links.warmup_for(0.2, 2000.0) == links.MAX_WARMUP_S


def test_client_reports_the_warmup_it_used(server):
    _, port = server
    out = subprocess.run(nodeside.command(sys.executable, "links", "client", "--peer", f"127.0.0.1:{port}",
                                          "--duration-s", "0.2", "--warmup-s", "0.1", "--rtt-samples", "5"),
                         capture_output=True, text=True, timeout=30)
    doc = parse_json_output(out.stdout)
    assert doc["warmup_s"] == links.warmup_for(0.1, doc["rtt_ms_min"]) and doc["bandwidth_mbit"] > 0
