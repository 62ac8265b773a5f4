"""The monitoring contract, in one place: every metric's name, kind, help and labels, and the ports.

The rank exporter (train/exporter.py), the node exporter (probe/node_exporter.py), the
Prometheus queries (monitor/query.py), `vpscluster top` and the Grafana dashboard all read these
definitions, so a metric cannot be renamed in one place and silently vanish from another.
Standard library only: the training workers and the node exporter import it on every node.

Ports (what a firewall between the nodes must allow, from the head only):

    NODE_PORT            9471/tcp   one node exporter per node
    RANK_PORT_BASE + i   9480+i     the exporter of local rank i (several ranks per node do
                                    not collide; a port already taken falls back to a free one,
                                    and the run lists the ports it really used)
    PROMETHEUS_PORT      9470/tcp   the Prometheus server `vpscluster monitor up` starts on the head
    DEBIAN_NODE_PORT     9100/tcp   Debian's prometheus-node-exporter (`monitor up --node-exporter
                                    debian|auto`), its usual port
    QUEUE_PORT           4222/tcp   NATS (JetStream) clients, `vpscluster queue up` on the head (token)
    QUEUE_MONITOR_PORT   8222/tcp   nats-server's own monitoring JSON (read-only counts, no messages)
    QUEUE_EXPORTER_PORT  9472/tcp   the queue's Prometheus exporter (nodeside/queue_exporter.py)

Exporters bind the address the node uses to reach the cluster (loopback on the local cluster),
never 0.0.0.0, so they are not published on other interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass

NODE_PORT = 9471
RANK_PORT_BASE = 9480
PROMETHEUS_PORT = 9470
DEBIAN_NODE_PORT = 9100
QUEUE_PORT = 4222
QUEUE_MONITOR_PORT = 8222
QUEUE_EXPORTER_PORT = 9472

# Step and sync times run from milliseconds (loopback) to minutes (a DiLoCo outer sync over a
# slow WAN link): the histogram's buckets must span all of that.
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # Grafana unit id: "s", "bytes", "Bps", "percentunit", ""

    @property
    def sample(self) -> str:
        """The name Prometheus stores (counters get `_total`; histograms are queried by `_bucket`)."""
        return self.name + "_total" if self.kind == "counter" else self.name


def _m(*args, **kw) -> Metric:
    return Metric(*args, **kw)


RANK_LABELS = ("rank", "node")

# --- per rank (inside every training worker) --------------------------------------------------
STEP = _m("vpscluster_step", "gauge", "last optimizer step finished", RANK_LABELS)
LOSS = _m("vpscluster_loss", "gauge", "training loss of the last step", RANK_LABELS)
VAL_LOSS = _m("vpscluster_val_loss", "gauge", "last validation loss", RANK_LABELS)
TOKENS_PER_S = _m("vpscluster_tokens_per_second", "gauge", "tokens/s of the whole run over the last step", RANK_LABELS)
TOKENS = _m("vpscluster_tokens", "counter", "tokens this rank trained on", RANK_LABELS)
STEP_SECONDS = _m("vpscluster_step_seconds", "histogram", "wall time of a step", RANK_LABELS, "s")
COMPUTE_SECONDS = _m("vpscluster_compute_seconds", "histogram", "compute time of a step", RANK_LABELS, "s")
COMM_SECONDS = _m("vpscluster_comm_seconds", "histogram", "communication time of a step", RANK_LABELS, "s")
SYNC_SECONDS = _m("vpscluster_sync_latency_seconds", "histogram",
                  "latency of one collective (kind: step = a step's gradient sync, outer = a DiLoCo outer sync)",
                  RANK_LABELS + ("kind",), "s")
BYTES_SENT = _m("vpscluster_bytes_sent", "counter", "bytes this rank sent in collectives", RANK_LABELS, "bytes")
BYTES_RECEIVED = _m("vpscluster_bytes_received", "counter",
                    "bytes this rank received in collectives (ring collectives: equal to those sent)", RANK_LABELS, "bytes")
OUTER_SYNCS = _m("vpscluster_outer_syncs", "counter", "DiLoCo outer syncs done", RANK_LABELS)
CHECKPOINT_SECONDS = _m("vpscluster_checkpoint_seconds", "histogram", "time to write a checkpoint", RANK_LABELS, "s")

RANK_METRICS = (STEP, LOSS, VAL_LOSS, TOKENS_PER_S, TOKENS, STEP_SECONDS, COMPUTE_SECONDS, COMM_SECONDS,
                SYNC_SECONDS, BYTES_SENT, BYTES_RECEIVED, OUTER_SYNCS, CHECKPOINT_SECONDS)

# --- per node -------------------------------------------------------------------------------------
NODE_LABELS = ("node",)
CPU_UTILIZATION = _m("vpscluster_node_cpu_utilization", "gauge",
                     "CPU busy share of what the node really has (usage over its cgroup quota where it has one)",
                     NODE_LABELS, "percentunit")
CPU_SECONDS = _m("vpscluster_node_cpu_seconds", "counter", "CPU seconds used by the node (its cgroup where it has a quota)",
                 NODE_LABELS, "s")
CPU_CAPACITY = _m("vpscluster_node_cpu_capacity_cores", "gauge", "cores the node may use (cgroup quota, else CPUs)", NODE_LABELS)
MEMORY_USED = _m("vpscluster_node_memory_used_bytes", "gauge", "memory in use", NODE_LABELS, "bytes")
MEMORY_TOTAL = _m("vpscluster_node_memory_total_bytes", "gauge", "memory the node may use", NODE_LABELS, "bytes")
NET_RX = _m("vpscluster_node_network_receive_bytes", "counter", "bytes received per interface", NODE_LABELS + ("interface",), "bytes")
NET_TX = _m("vpscluster_node_network_transmit_bytes", "counter", "bytes sent per interface", NODE_LABELS + ("interface",), "bytes")
LINK_CAPACITY = _m("vpscluster_node_link_capacity_bytes_per_second", "gauge",
                   "the node's measured link capacity (from the probe; absent when not probed)", NODE_LABELS, "Bps")
DISK_USED = _m("vpscluster_node_disk_used_bytes", "gauge", "disk used on the workdir's file system", NODE_LABELS, "bytes")
DISK_TOTAL = _m("vpscluster_node_disk_total_bytes", "gauge", "size of the workdir's file system", NODE_LABELS, "bytes")

NODE_METRICS = (CPU_UTILIZATION, CPU_SECONDS, CPU_CAPACITY, MEMORY_USED, MEMORY_TOTAL, NET_RX, NET_TX,
                LINK_CAPACITY, DISK_USED, DISK_TOTAL)

ALL_METRICS = RANK_METRICS + NODE_METRICS

# --- the queue (nodeside/queue_exporter.py beside nats-server on the head; `top` reads them) ---------
QUEUE_UP = _m("vpscluster_queue_up", "gauge", "1 when nats-server answered this scrape")
QUEUE_IN_MESSAGES = _m("vpscluster_queue_in_messages", "counter", "nats-server in_msgs")
QUEUE_IN_BYTES = _m("vpscluster_queue_in_bytes", "counter", "nats-server in_bytes", unit="bytes")
QUEUE_OUT_MESSAGES = _m("vpscluster_queue_out_messages", "counter", "nats-server out_msgs")
QUEUE_OUT_BYTES = _m("vpscluster_queue_out_bytes", "counter", "nats-server out_bytes", unit="bytes")
QUEUE_STREAM_MESSAGES = _m("vpscluster_queue_stream_messages", "gauge", "messages stored in the stream", ("stream",))
QUEUE_STREAM_BYTES = _m("vpscluster_queue_stream_bytes", "gauge", "bytes stored in the stream", ("stream",), "bytes")
QUEUE_PUBLISHED = _m("vpscluster_queue_stream_published", "counter", "messages published to the stream so far", ("stream",))
QUEUE_LAG = _m("vpscluster_queue_consumer_pending", "gauge", "lag: stored messages not yet delivered to the consumer",
               ("stream", "consumer"))
QUEUE_UNACKED = _m("vpscluster_queue_consumer_ack_pending", "gauge", "delivered, not yet acknowledged", ("stream", "consumer"))
QUEUE_REDELIVERED = _m("vpscluster_queue_consumer_redelivered", "gauge", "messages delivered again (not acked in time)",
                       ("stream", "consumer"))
QUEUE_DELIVERED = _m("vpscluster_queue_consumer_delivered", "counter", "messages delivered to the consumer, redeliveries too",
                     ("stream", "consumer"))
QUEUE_METRICS = (QUEUE_UP, QUEUE_IN_MESSAGES, QUEUE_IN_BYTES, QUEUE_OUT_MESSAGES, QUEUE_OUT_BYTES, QUEUE_STREAM_MESSAGES,
                 QUEUE_STREAM_BYTES, QUEUE_PUBLISHED, QUEUE_LAG, QUEUE_UNACKED, QUEUE_REDELIVERED, QUEUE_DELIVERED)


def rank_port(local_rank: int) -> int:
    return RANK_PORT_BASE + local_rank
