"""A small TCP measurement tool (server and client), self-contained, run on the nodes.

Sent to each node as source (standard library only; see `vpscluster.nodeside`). Like iperf3, bandwidth is what the
*receiver* counts: the server counts the bytes that arrive on each stream during a fixed window
that opens `warmup_s` after the first byte (so TCP slow start and a shaper's initial burst are
left out), then reports the count back on the same connection. The warm-up lasts at least
`SLOW_START_RTTS` round trips of the link (measured first): slow start doubles the window each
round trip, so a warm-up that is plenty on a LAN is stretched on a WAN link, never counting its
ramp-up. Round-trip time is a ping-pong of one byte on a TCP_NODELAY connection; each reply carries the server's wall clock, which gives
the NTP-style clock offset (server time minus the midpoint of the client's send and receive).

    server --bind ADDR [--port P] [--idle-timeout-s S]   prints "LISTENING <port>", serves
    client --peer HOST:PORT [--rtt-samples N] [--duration-s D] [--warmup-s W] [--streams K]
                                                         prints one JSON object
"""

import argparse
import errno
import json
import socket
import statistics
import struct
import sys
import threading
import time

CHUNK = 256 * 1024
SLOW_START_RTTS = 12  # 2**12 initial windows (~60 MB): past any link's bandwidth-delay product
MAX_WARMUP_S = 3.0


def warmup_for(warmup_s, rtt_ms_min):
    """The warm-up to use: `warmup_s`, or longer where the link's round trip needs it."""
    if rtt_ms_min is None:
        return warmup_s
    return max(warmup_s, min(MAX_WARMUP_S, SLOW_START_RTTS * rtt_ms_min / 1000.0))


def _recv_line(sock, limit=4096):
    data = b""
    while not data.endswith(b"\n"):
        part = sock.recv(1)
        if not part:
            raise ConnectionError("connection closed before a full line arrived")
        data += part
        if len(data) > limit:
            raise ConnectionError("header line too long")
    return data.decode()


# ---------------------------------------------------------------- server

def _serve_sink(conn, req):
    warmup_s, duration_s = float(req["warmup_s"]), float(req["duration_s"])
    conn.settimeout(warmup_s + duration_s + 30)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n = conn.recv_into(view)
    if n == 0:
        return
    window_open = time.perf_counter() + warmup_s
    counted, start = 0, None
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        now = time.perf_counter()
        if now < window_open:
            continue
        if start is None:
            start = now  # bytes of this recv arrived before `now`: do not count them
            continue
        counted += n
        if now - start >= duration_s:
            break
    seconds = (time.perf_counter() - start) if start else 0.0
    conn.sendall((json.dumps({"bytes": counted, "seconds": seconds}) + "\n").encode())
    # Drain until the client closes, so it never sees a reset while still sending.
    conn.settimeout(5)
    try:
        while conn.recv_into(view):
            pass
    except OSError:
        pass


def _serve_ping(conn):
    conn.settimeout(30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = conn.recv(1)
        if not b:
            return
        conn.sendall(struct.pack("!d", time.time()))


def _handle(conn, state):
    try:
        req = json.loads(_recv_line(conn))
        if req.get("op") == "sink":
            _serve_sink(conn, req)
        elif req.get("op") == "ping":
            _serve_ping(conn)
    except (OSError, ValueError, KeyError):
        pass
    finally:
        conn.close()
        state["last"] = time.monotonic()


def serve(bind, port, idle_timeout_s):
    srv = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind((bind, port))
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        # Not an address of this node (a provider's 1:1 NAT): every interface of that family.
        srv.bind(("::" if ":" in bind else "0.0.0.0", port))
    srv.listen(64)
    srv.settimeout(1.0)
    print(f"LISTENING {srv.getsockname()[1]}", flush=True)
    state = {"last": time.monotonic()}
    # Exit on its own when nobody has talked to it for a while: never a process left behind.
    while time.monotonic() - state["last"] < idle_timeout_s:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        state["last"] = time.monotonic()
        threading.Thread(target=_handle, args=(conn, state), daemon=True).start()
    return 0


# ---------------------------------------------------------------- client

def _connect(host, port, timeout_s):
    t0 = time.perf_counter()
    sock = socket.create_connection((host, port), timeout=timeout_s)
    return sock, (time.perf_counter() - t0) * 1000.0


def measure_rtt(host, port, samples, timeout_s):
    sock, connect_ms = _connect(host, port, timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b'{"op": "ping"}\n')
        rtts, offsets = [], []
        for _ in range(samples):
            w0, t0 = time.time(), time.perf_counter()
            sock.sendall(b"p")
            reply = b""
            while len(reply) < 8:
                part = sock.recv(8 - len(reply))
                if not part:
                    raise ConnectionError("peer closed the ping connection")
                reply += part
            rtt = time.perf_counter() - t0
            (server_time,) = struct.unpack("!d", reply)
            rtts.append(rtt)
            offsets.append((rtt, server_time - (w0 + rtt / 2)))
    finally:
        sock.close()
    ordered = sorted(rtts)
    best_rtt, best_offset = min(offsets)  # the fastest exchange bounds the offset best
    return {
        "rtt_ms": statistics.median(ordered) * 1000.0,
        "rtt_ms_min": ordered[0] * 1000.0,
        "rtt_ms_p95": ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))] * 1000.0,
        "rtt_samples": len(ordered),
        "connect_ms": connect_ms,
        "clock_offset_s": best_offset,
        "clock_uncertainty_s": best_rtt / 2,
    }


def _stream(host, port, warmup_s, duration_s, timeout_s, results, i):
    try:
        sock, _ = _connect(host, port, timeout_s)
    except OSError as e:
        results[i] = {"error": f"connect: {e}"}
        return
    stop = threading.Event()

    def send():
        payload = b"\0" * CHUNK
        try:
            while not stop.is_set():
                sock.sendall(payload)
        except OSError:
            pass

    try:
        sock.settimeout(warmup_s + duration_s + timeout_s + 10)
        sock.sendall((json.dumps({"op": "sink", "warmup_s": warmup_s, "duration_s": duration_s}) + "\n").encode())
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        line = b""
        while not line.endswith(b"\n"):
            part = sock.recv(4096)
            if not part:
                raise ConnectionError("server closed before reporting")
            line += part
        results[i] = json.loads(line.decode())
    except (OSError, ValueError) as e:
        results[i] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        stop.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def measure_bandwidth(host, port, streams, warmup_s, duration_s, timeout_s):
    results = [None] * streams
    threads = [threading.Thread(target=_stream, args=(host, port, warmup_s, duration_s, timeout_s, results, i),
                                daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(warmup_s + duration_s + 2 * timeout_s + 15)
    errors = [(r or {}).get("error", "a stream did not finish in time") for r in results if r is None or "error" in r]
    if errors:
        return {"bandwidth_error": errors[0]}
    total_bits_per_s = sum(8.0 * r["bytes"] / r["seconds"] for r in results if r["seconds"] > 0)
    return {"bandwidth_mbit": total_bits_per_s / 1e6, "bytes": sum(r["bytes"] for r in results),
            "seconds": max(r["seconds"] for r in results), "streams": streams}


def main(argv):
    p = argparse.ArgumentParser(prog="links")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--idle-timeout-s", type=float, default=120.0)
    c = sub.add_parser("client")
    c.add_argument("--peer", required=True, help="HOST:PORT")
    c.add_argument("--rtt-samples", type=int, default=20)
    c.add_argument("--duration-s", type=float, default=2.0, help="0 skips the bandwidth test")
    c.add_argument("--warmup-s", type=float, default=0.5)
    c.add_argument("--streams", type=int, default=1)
    c.add_argument("--timeout-s", type=float, default=5.0)
    args = p.parse_args(argv[1:])
    if args.cmd == "server":
        return serve(args.bind, args.port, args.idle_timeout_s)
    host, _, port = args.peer.rpartition(":")
    host = host.strip("[]")
    out = {}
    try:
        if args.rtt_samples > 0:
            out.update(measure_rtt(host, int(port), args.rtt_samples, args.timeout_s))
        if args.duration_s > 0:
            out["warmup_s"] = warmup_for(args.warmup_s, out.get("rtt_ms_min"))
            out.update(measure_bandwidth(host, int(port), args.streams, out["warmup_s"], args.duration_s, args.timeout_s))
    except OSError as e:
        out["error"] = f"{host}:{port}: {e.strerror or e}"
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
