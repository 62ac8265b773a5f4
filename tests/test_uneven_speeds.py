"""`train --balance` without `--speeds` starts from the probe's per-node speeds (each node's
FLOP/s, quota included, divided among its ranks); a `--speeds` list of the wrong length is
refused by the launcher, in one line, before anything starts."""

from __future__ import annotations

import time

import pytest

from vpscluster.train.shares import node_speeds_from_probe, rank_speeds, split


def _node(name, flops=None, cpu_share=1.0, gpus=(), device="cpu"):
    return {"name": name, "flops": flops, "flops_device": device, "cpu_share": cpu_share,
            "gpus": [{"name": g, "memory_bytes": 16 << 30} for g in gpus]}


def test_probe_speeds_are_node_flops_divided_among_its_ranks():
    probe = {"nodes": [_node("a", 90e9, 3.0), _node("b", 30e9, 1.0), _node("c", 20e9, 0.3)]}
    got = node_speeds_from_probe(probe, {"a": 2, "b": 1, "c": 1})
    assert got == pytest.approx({"a": 45e9, "b": 30e9, "c": 20e9})
    # rank order follows the node each rank runs on, not the cluster file's order
    assert rank_speeds(["b", "a", "c", "a"], got) == pytest.approx([30e9, 45e9, 20e9, 45e9])
    assert rank_speeds(["a", "x"], got) is None
    # and the shares follow: two ranks at 45, one at 30, one at 20 GFLOP/s split 16 micro-batches
    assert split(rank_speeds(["a", "a", "b", "c"], got), 16) == [6, 5, 3, 2]


def test_gpu_node_counts_each_device_and_cpu_share_is_the_fallback():
    gpu = _node("g", 100e12, 8.0, gpus=("T4", "T4"), device="cuda")
    cpu = _node("c", 50e9, 2.0)
    assert node_speeds_from_probe({"nodes": [gpu, cpu]}, {"g": 2, "c": 1}) == pytest.approx({"g": 100e12, "c": 50e9})
    # one node without a FLOP/s figure (torch missing): every node by the CPU it really gets
    no_torch = _node("b", None, 0.5)
    assert node_speeds_from_probe({"nodes": [cpu, no_torch]}, {"c": 1, "b": 1}) == pytest.approx({"c": 2.0, "b": 0.5})
    # a node the probe never saw, or no probe at all: None (the launcher starts even)
    assert node_speeds_from_probe({"nodes": [cpu]}, {"c": 1, "b": 1}) is None
    assert node_speeds_from_probe(None, {"c": 1}) is None
    assert node_speeds_from_probe({"nodes": [cpu, _node("b", None, None)]}, {"c": 1, "b": 1}) is None


def _cluster_file(tmp_path, names=("n1", "n2", "n3")):
    # TEST-NET addresses: nothing answers there, so reaching a node would hang until a time-out.
    lines = ["nodes:"] + [f"  - {{name: {n}, host: 192.0.2.{i + 1}}}" for i, n in enumerate(names)]
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _save_probe(path, nodes):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.probe.store import fingerprint, save_probe

    cluster = load_cluster(str(path))
    save_probe(cluster, {"cluster": {"fingerprint": fingerprint(cluster)}, "probed_at_unix": time.time(), "nodes": nodes})


@pytest.mark.parametrize("extra,probe,needle", [
    (("--nproc-per-node", "2"), None, "6 ranks"),
    ((), [_node("n1", 1e9), _node("n2", 1e9, gpus=("T4", "T4"), device="cuda"), _node("n3", 1e9)], "4 ranks"),
])
def test_wrong_speeds_count_on_a_cluster_is_refused_before_anything_starts(cli, tmp_path, extra, probe, needle):
    path = _cluster_file(tmp_path)
    if probe:
        _save_probe(path, probe)
    started = time.monotonic()
    r = cli("train", "--cluster", str(path), "--micro-batches", "8", "--speeds", "3,1", *extra,
            "--run-dir", str(tmp_path / "run"), timeout=120, env={"HOME": str(tmp_path)})
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--speeds gives 2 figures" in lines[0] and needle in lines[0], lines[0]
    assert time.monotonic() - started < 60  # no node was contacted (they would not answer)
    assert not (tmp_path / "run").exists()


def test_balance_without_speeds_starts_from_the_probe_or_even(tmp_path, monkeypatch):
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.train import starting_speeds
    from vpscluster.train.config import resolve

    monkeypatch.setenv("HOME", str(tmp_path))
    path = _cluster_file(tmp_path)
    cluster = load_cluster(str(path))

    def cfg(**strategy):
        return resolve(None, {"cluster": str(path), "strategy": {"micro_batches": 8, "balance": True, **strategy}})

    c = cfg()
    note = starting_speeds(c, cluster)
    assert c.strategy.launcher.node_speeds is None and "no probe" in note and "start even" in note
    _save_probe(path, [_node("n1", 60e9, 2.0), _node("n2", 30e9, 1.0), _node("n3", 15e9, 0.5)])
    c = cfg()
    note = starting_speeds(c, cluster)
    assert c.strategy.launcher.node_speeds == pytest.approx({"n1": 60e9, "n2": 30e9, "n3": 15e9})
    assert "probe" in note and "n3 0.25" in note
    c = cfg(speeds=[1, 1, 1])  # explicit --speeds wins
    assert starting_speeds(c, cluster) is None and c.strategy.launcher.node_speeds is None
    c = resolve(None, {"cluster": str(path), "nproc_per_node": 2, "strategy": {"micro_batches": 12, "balance": True}})
    starting_speeds(c, cluster)
    assert c.strategy.launcher.node_speeds == pytest.approx({"n1": 30e9, "n2": 15e9, "n3": 7.5e9})
