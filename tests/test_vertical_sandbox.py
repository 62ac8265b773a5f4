"""The vertical split on a 3-node sandbox (SSH nodes in their own network namespaces): `queue up`
starts nats-server on the head (node-1), the text tower runs on node-2, the image tower on node-3,
the head on node-1, all started over SSH by the executors; it trains (each sample exactly once),
and each node holds only its own stage's files: the text node the ids and descriptions, the image
node the ids and images, the head the ids and labels.

Not here: the firewall closing the queue's port to a namespace outside the cluster is
provision's (nftables) work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from sandbox_fixtures import SandboxFactory

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nats-server") is None, reason="no nats-server (apt install nats-server)")]


def test_towers_on_their_nodes_over_the_head_queue(tmp_path):
    import yaml

    from vpscluster.vertical import products

    factory = SandboxFactory(kind="vt-")
    try:
        info = factory(nodes=3, bandwidth="1gbit")
        r = run_cli("queue", "up", "--cluster", info.cluster_file, "--json", timeout=180)
        assert r.returncode == 0, r.stderr
        try:
            rows = products.generate(320, seed=1)
            data = tmp_path / "products.jsonl"
            data.write_text("".join(json.dumps(row) + "\n" for row in rows))
            names = [n.name for n in info.nodes]
            doc = products.spec_doc(str(data), names, names[0], epochs=2)
            doc["train"]["steps"] = 6
            spec = tmp_path / "spec.yaml"
            spec.write_text(yaml.safe_dump(doc, sort_keys=False))
            r = run_cli("vertical", "train", "--spec", str(spec), "--cluster", info.cluster_file,
                        "--run-dir", str(tmp_path / "run"), "--json", timeout=240)
            assert r.returncode == 0, r.stderr[-3000:]
        finally:
            run_cli("queue", "down", "--cluster", info.cluster_file, "--purge", timeout=120)
        report = json.loads(r.stdout)
        assert report["placement"] == {"text": names[1], "image": names[2], "head": names[0]}
        assert report["queue"] == f"nats://{info.node(names[0]).address}:4222"
        assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256, 128]
        assert report["val_samples"] == 64 and report["bytes_per_sample"] > 0

        want = {"text": {"id", "description"}, "image": {"id", "image"}, "head": {"id", "label"}}
        for stage, node in report["placement"].items():
            runs = Path(info.node(node).workdir) / "runs" / f"vertical-{report['run_id']}"
            assert sorted(p.name for p in runs.iterdir()) == [stage]  # nothing of the other stages
            sent = [json.loads(line) for line in (runs / stage / "in" / "rows.jsonl").read_text().splitlines()]
            assert [set(x) for x in sent] == [want[stage]] * len(rows)
            assert sorted(p.name for p in (runs / stage / "in").iterdir()) == ["rows.jsonl"]
        # the trained weights came back from the nodes
        for stage in ("text", "image"):
            assert (tmp_path / "run" / "stages" / stage / f"tower-{stage}.pt").is_file()
        assert (tmp_path / "run" / "stages" / "head" / "report.json").is_file()
    finally:
        factory.close()
