"""A vertical split's stage moves to another node when its node is gone for good (#35).

Four real sshd nodes on loopback (tests/cluster_sshd.py), each with its own workdir, and a private
nats-server named in the cluster file as the user's queue. The head runs on node-a, the text tower
on node-d, the image tower as 2 replicas placed by labels (`images: "1"`, carried by node-b, node-c
and node-d): on node-b and node-c. Mid-run node-c dies for good: its sshd and every process under
it are killed and its workdir (its disk) is removed. The launcher finds node-c silent and starts
image.1 on node-d: a live node carrying the labels (node-a, as loaded and first in the file, does
not), without the other image replica (node-b has it), from the checkpoint on the queue's object
store, not from a disk; the run finishes with
every sample trained exactly once per epoch, the replicas' weights equal bit for bit and every
stage's weights those of the one-process model (K = 0).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from cluster_sshd import SSHDFarm, sshd_unavailable_reason

pytestmark = [pytest.mark.skipif(shutil.which("nats-server") is None, reason="no nats-server (apt install nats-server)"),
              pytest.mark.skipif(sshd_unavailable_reason() is not None, reason=str(sshd_unavailable_reason()))]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_replica_moves_off_a_dead_node_and_resumes_from_the_queue(tmp_path):
    import yaml

    import torch

    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.queue.server import serve_private
    from vpscluster.vertical import launch, products, reference, spec as spec_mod

    rows = products.generate(320, seed=3)
    data = tmp_path / "products.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    farm = SSHDFarm(tmp_path / "sshd", 4)
    server = serve_private(tmp_path / "queue")
    try:
        token = tmp_path / "nats.token"
        token.write_text(server.creds.token)
        token.chmod(0o600)
        cluster_file = farm.cluster_yaml(tmp_path / "cluster.yaml", farm.known_hosts(tmp_path / "known_hosts"),
                                         connect_timeout_s=5, queue={"url": server.creds.url, "token_file": str(token)})
        doc = yaml.safe_load(cluster_file.read_text())
        for n in doc["nodes"]:
            n.update({"workdir": str(tmp_path / "disk" / n["name"]), "python": sys.executable})
            if n["name"] != "node-a":
                n["labels"] = {"images": "1"}
        cluster_file.write_text(yaml.safe_dump(doc, sort_keys=False))
        cluster = load_cluster(cluster_file)
        a, b, c, d = (n.name for n in farm.nodes)

        doc = products.spec_doc(str(data), [a, b, c, d], a, epochs=4)
        doc["towers"]["text"]["nodes"] = [d]
        doc["towers"]["image"].update({"nodes": [], "labels": {"images": "1"}, "replicas": 2})
        doc["train"].update({"steps": 12, "checkpoint_every": 3})
        spec = spec_mod.from_dict(doc)
        lines, killed, t_kill = [], [], []

        def say(line: str) -> None:
            lines.append(line)
            if "tower image.1: resumed" in line:
                t_kill.append(time.monotonic())
            if not killed and line.startswith(f"[head@{a}] step 5/12"):  # node-c dies: processes, sshd, disk
                dead = farm.nodes[2].proc
                for pid in _descendants(dead.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
                dead.kill()
                dead.wait(10)
                shutil.rmtree(tmp_path / "disk" / c)
                t_kill.append(time.monotonic())

        report = launch.train(spec, cluster, run_dir=tmp_path / "run", say=say)
    finally:
        server.stop()
        farm.stop()

    assert killed, lines
    print(f"image.1 resumed on another node {t_kill[1] - t_kill[0]:.1f} s after its node died")
    assert t_kill[1] - t_kill[0] < 60, lines
    moved = [ln for ln in lines if ln.startswith("vertical: ")]
    assert len(moved) == 1 and moved[0].startswith(f"vertical: {c} is gone; tower image.1 restarts on {d} from step "), lines
    step = int(moved[0].rsplit(" ", 1)[1])
    assert step % 3 == 0 and 3 <= step < 12, lines  # its checkpoint on the queue, not the start
    assert report["moves"] == [{"stage": "image.1", "from": c, "to": d, "step": step}]
    assert report["placement"] == {"text": d, "image.0": b, "image.1": d, "head": a}
    assert report["restarts"] == {"image.1": 1}
    assert any(f"tower image.1: resumed from its checkpoint after step {step}" in ln for ln in lines), lines
    assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256, 256, 256]
    assert report["val_samples"] == 64
    # node-d received image.1's share of the images (its columns only) besides its text tower's
    on_d = tmp_path / "disk" / d / "runs" / f"vertical-{report['run_id']}"
    assert sorted(p.name for p in on_d.iterdir()) == ["image.1", "text"]
    sent = [json.loads(ln) for ln in (on_d / "image.1" / "in" / "rows.jsonl").read_text().splitlines()]
    assert sent and all(set(x) == {"id", "image"} for x in sent)

    _, ref_states = reference.train(spec, rows)
    stages = tmp_path / "run" / "stages"
    weights = {st: torch.load(stages / st / ("head.pt" if st == "head" else f"tower-{st.split('.')[0]}.pt"),
                              weights_only=True) for st in spec.stages()}
    for name in ref_states["image"]:
        assert torch.equal(weights["image.0"][name], weights["image.1"][name]), name
    for st, got in weights.items():
        ref = ref_states[st.split(".")[0]]
        for name in ref:
            assert torch.allclose(got[name], ref[name], rtol=1e-4, atol=1e-5), f"{st}.{name}"
