"""The vertical split on a 3-node sandbox (SSH nodes in their own network namespaces): `queue up`
starts nats-server on the head (node-1), the text tower runs on node-2, the image tower on node-3,
the head on node-1, all started over SSH by the executors; it trains (each sample exactly once),
and each node holds only its own stages' files: the text node the ids and descriptions, the image
node the ids and images, the head the ids and labels. The image tower runs as 2 replicas, on
node-2 and node-3: each of those nodes holds the images of its share of the rows only, and the
replicas end with the same weights.

Node-3 then dies for good mid-run (every process of its namespace, its sshd daemon included,
killed: `sandbox fault kill` and the daemon): the launcher finds it silent and starts image.1 on
node-2 (the image tower is placed by `nodes: [node-2, node-3]`, so its images may reach no other
node) from its checkpoint on the queue's object store; every sample is still trained exactly once per epoch and the replicas' weights
stay equal.

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


def _train_killing(info, node: str, when: str, *args: str, timeout_s: float = 240.0):
    """`vpscluster ARGS` in a child; once a line starts with `when`, `node` dies for good: `fault
    kill` (its processes but its sshd daemon), then the daemon. (exit status, stdout, stderr lines)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from vpscluster.cluster.sandbox import faults

    p = subprocess.Popen([sys.executable, "-m", "vpscluster", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    reader.start()
    timer = threading.Timer(timeout_s, p.kill)
    timer.start()
    lines, killed = [], False
    try:
        for line in p.stderr:
            lines.append(line)
            if not killed and line.startswith(when):
                faults.inject(info.name, node, "kill")
                daemon = Path(info.state_dir) / "nodes" / node / "sshd.pid"
                os.kill(int(daemon.read_text().strip()), signal.SIGKILL)
                killed = True
        p.wait(30)
        reader.join(30)
    finally:
        timer.cancel()
        if p.poll() is None:
            p.kill()
    assert killed, "".join(lines)
    return p.returncode, "".join(out), lines


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
            doc["train"].update({"steps": 8, "checkpoint_every": 2})
            doc["towers"]["image"]["nodes"] = [names[1], names[2]]
            spec = tmp_path / "spec.yaml"
            spec.write_text(yaml.safe_dump(doc, sort_keys=False))
            rc, out, lines = _train_killing(info, names[2], f"[head@{names[0]}] step 3/8",
                                            "vertical", "train", "--spec", str(spec), "--cluster", info.cluster_file,
                                            "--run-dir", str(tmp_path / "run"), "--json")
            assert rc == 0, "".join(lines)[-3000:]
        finally:
            run_cli("queue", "down", "--cluster", info.cluster_file, "--purge", timeout=120)
        report = json.loads(out)
        moved = [ln for ln in lines if ln.startswith("vertical: ")]
        # the image tower is placed by nodes: [node-2, node-3], so its replica moves to node-2 only
        assert len(moved) == 1 and moved[0].startswith(
            f"vertical: {names[2]} is gone; tower image.1 restarts on {names[1]} from step "), "".join(lines)
        step = int(moved[0].split()[-1])
        assert step in (2, 4) and report["moves"] == [{"stage": "image.1", "from": names[2], "to": names[1], "step": step}]
        assert report["placement"] == {"text": names[1], "image.0": names[1], "image.1": names[1], "head": names[0]}
        assert report["queue"] == f"nats://{info.node(names[0]).address}:4222"
        assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256, 256]
        assert report["val_samples"] == 64 and report["bytes_per_sample"] > 0

        want = {"text": {"id", "description"}, "image.0": {"id", "image"}, "image.1": {"id", "image"},
                "head": {"id", "label"}}
        image_ids = []
        for node in set(report["placement"].values()):
            runs = Path(info.node(node).workdir) / "runs" / f"vertical-{report['run_id']}"
            here = sorted(st for st, n in report["placement"].items() if n == node)
            assert sorted(p.name for p in runs.iterdir()) == here  # nothing of the other stages
            for stage in here:
                sent = [json.loads(line) for line in (runs / stage / "in" / "rows.jsonl").read_text().splitlines()]
                assert all(set(x) == want[stage] for x in sent)
                extra = ["ids.json"] if stage.startswith("image.") else []
                assert sorted(p.name for p in (runs / stage / "in").iterdir()) == sorted(["rows.jsonl", *extra])
                if extra:
                    image_ids.append({x["id"] for x in sent})
                else:
                    assert len(sent) == len(rows)
        # each image replica's node holds its share of the images only
        assert not image_ids[0] & image_ids[1] and len(image_ids[0] | image_ids[1]) == len(rows)
        # the trained weights came back from the nodes; the replicas' are equal
        import torch

        stages = tmp_path / "run" / "stages"
        assert (stages / "text" / "tower-text.pt").is_file()
        w0, w1 = (torch.load(stages / st / "tower-image.pt", weights_only=True) for st in ("image.0", "image.1"))
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
        assert (tmp_path / "run" / "stages" / "head" / "report.json").is_file()
    finally:
        factory.close()
