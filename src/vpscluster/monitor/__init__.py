"""Monitoring on Prometheus: a real server on the head (server.py), the load figures scheduling
reads from it (query.py), the live view (top.py), the HTML report of a run (report.py) and the
Grafana dashboard (dashboard.py). Metric names and ports are defined once, in `vpscluster.telemetry`;
the exporters themselves run on the nodes (probe/node_exporter.py, train/exporter.py)."""
