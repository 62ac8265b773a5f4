"""The queue's exporter: NATS JetStream's monitoring JSON as Prometheus metrics (stdlib only).

    python queue_exporter.py --nats-monitor http://ADDR:8222 --bind ADDR --port 9472 [--tag T]

`vpscluster queue up` starts it on the head beside nats-server, bound to the same address (never
0.0.0.0). Each scrape reads `/varz` and `/jsz?accounts=true&streams=true&consumers=true` and
serves (names are the contract; `top` and queries read them):

    vpscluster_queue_up                                  1 when nats-server answered this scrape
    vpscluster_queue_in_messages_total / _in_bytes_total / _out_messages_total / _out_bytes_total
                                                         the server's counters (throughput: rate())
    vpscluster_queue_stream_messages{stream}             stored messages
    vpscluster_queue_stream_bytes{stream}                stored bytes
    vpscluster_queue_stream_published_total{stream}      published so far (its last sequence; rate(): publish throughput)
    vpscluster_queue_consumer_pending{stream,consumer}   lag: stored, not yet delivered to it
    vpscluster_queue_consumer_ack_pending{stream,consumer}   delivered, not yet acknowledged
    vpscluster_queue_consumer_redelivered{stream,consumer}   delivered again (not acked in time)
    vpscluster_queue_consumer_delivered_total{stream,consumer}  deliveries, redeliveries too (rate(): consume throughput)

The names are telemetry.QUEUE_METRICS' (a test keeps the two equal; this file imports no vpscluster).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FETCH_TIMEOUT_S = 3.0


def _get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base.rstrip("/") + path, timeout=FETCH_TIMEOUT_S) as r:
        return json.loads(r.read())


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(varz: dict | None, jsz: dict | None) -> str:
    """Prometheus text format from the two documents (None: the server did not answer)."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, rows: list[tuple[dict, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in rows:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
            out.append(f"{name}{{{lab}}} {float(value)!r}" if lab else f"{name} {float(value)!r}")

    metric("vpscluster_queue_up", "gauge", "1 when nats-server answered this scrape", [({}, 1 if varz and jsz else 0)])
    if varz:
        for key, name in (("in_msgs", "in_messages"), ("in_bytes", "in_bytes"), ("out_msgs", "out_messages"),
                          ("out_bytes", "out_bytes")):
            metric(f"vpscluster_queue_{name}_total", "counter", f"nats-server {key}", [({}, varz.get(key, 0))])
    streams, consumers = [], []
    for account in (jsz or {}).get("account_details") or []:
        for s in account.get("stream_detail") or []:
            streams.append(s)
            consumers += [(s["name"], c) for c in s.get("consumer_detail") or []]
    metric("vpscluster_queue_stream_messages", "gauge", "messages stored in the stream",
           [({"stream": s["name"]}, s["state"].get("messages", 0)) for s in streams])
    metric("vpscluster_queue_stream_bytes", "gauge", "bytes stored in the stream",
           [({"stream": s["name"]}, s["state"].get("bytes", 0)) for s in streams])
    metric("vpscluster_queue_stream_published_total", "counter", "messages published to the stream so far",
           [({"stream": s["name"]}, s["state"].get("last_seq", 0)) for s in streams])
    for key, name, help_ in (("num_pending", "pending", "lag: stored messages not yet delivered to the consumer"),
                             ("num_ack_pending", "ack_pending", "delivered, not yet acknowledged"),
                             ("num_redelivered", "redelivered", "messages delivered again (not acked in time)")):
        metric(f"vpscluster_queue_consumer_{name}", "gauge", help_,
               [({"stream": s, "consumer": c["name"]}, c.get(key, 0)) for s, c in consumers])
    metric("vpscluster_queue_consumer_delivered_total", "counter", "messages delivered to the consumer, redeliveries too",
           [({"stream": s, "consumer": c["name"]}, (c.get("delivered") or {}).get("consumer_seq", 0)) for s, c in consumers])
    return "\n".join(out) + "\n"


def scrape(base: str) -> str:
    try:
        varz = _get(base, "/varz")
        jsz = _get(base, "/jsz?accounts=true&streams=true&consumers=true")
    except (OSError, ValueError):
        varz = jsz = None
    return render(varz, jsz)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nats-monitor", required=True, help="nats-server's monitoring URL (http://ADDR:PORT)")
    p.add_argument("--bind", required=True, help="the address to listen on (the cluster's or overlay's, never 0.0.0.0)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tag", default="", help="a marker on the command line (lets `queue down` recognise this process)")
    args = p.parse_args(argv)
    base = args.nats_monitor

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = scrape(base).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.bind, args.port), Handler)
    print(f"queue exporter for {base} on {args.bind}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
