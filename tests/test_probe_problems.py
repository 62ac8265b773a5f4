"""Problem rules on synthetic probes: each rule fires on its case and stays quiet otherwise."""

import pytest

from vpscluster.probe.problems import Thresholds, blocking_problems, find_problems

TCP_DEFAULT = {"rmem_max": 212992, "wmem_max": 212992, "tcp_rmem": [4096, 131072, 6291456],
               "tcp_wmem": [4096, 16384, 4194304], "congestion_control": "cubic"}


def node(name, **kw):
    base = {"name": name, "host": f"10.0.0.{ord(name[-1]) % 250}", "reachable": True, "python": "3.11.7",
            "torch": "2.13.0", "cuda": None, "nccl": None, "gloo_available": True, "cpu_count": 4, "cpu_share": 4.0,
            "memory_bytes": 32 * 2**30, "disk_read_mb_s": 900.0, "gpus": [], "flops": 1e11,
            "advertised_bandwidth_mbit": 1000.0, "tcp": dict(TCP_DEFAULT), "clock_offset_s": 0.0}
    base.update(kw)
    return base


def link(src, dst, bw=950.0, rtt=1.0, **kw):
    return {"src": src, "dst": dst, "bandwidth_mbit": bw, "rtt_ms": rtt, **kw}


def full_mesh(names, bw=950.0, rtt=1.0):
    return [link(a, b, bw, rtt) for a in names for b in names if a != b]


def codes(problems):
    return sorted({p["code"] for p in problems})


def test_healthy_cluster_has_no_problems():
    probe = {"nodes": [node("a"), node("b"), node("c")], "links": full_mesh("abc")}
    assert find_problems(probe) == []
    assert blocking_problems({"problems": []}) == []


def test_problem_shape():
    probe = {"nodes": [node("a"), node("b", torch=None)], "links": []}
    (p,) = find_problems(probe)
    assert set(p) == {"severity", "code", "message", "nodes", "fix"}
    assert p["severity"] == "error" and p["code"] == "torch_missing" and p["nodes"] == ["b"]
    assert "\n" not in p["message"] and "\n" not in p["fix"]


@pytest.mark.parametrize("key,label", [("torch", "PyTorch"), ("cuda", "CUDA"), ("nccl", "NCCL")])
def test_version_mismatch_names_the_odd_node(key, label):
    nodes = [node("a", **{key: "1.0"}), node("b", **{key: "1.0"}), node("c", **{key: "2.0"})]
    probs = find_problems({"nodes": nodes, "links": []})
    (p,) = [p for p in probs if p["code"] == "version_mismatch"]
    assert p["severity"] == "error" and p["nodes"] == ["c"] and label in p["message"]
    assert "2.0 on c" in p["message"] and "1.0" in p["fix"]
    assert p in blocking_problems({"problems": probs})


def test_python_minor_is_error_patch_is_warning():
    minor = find_problems({"nodes": [node("a"), node("b", python="3.12.1")], "links": []})
    assert [(p["code"], p["severity"]) for p in minor] == [("version_mismatch", "error")]
    patch = find_problems({"nodes": [node("a"), node("b"), node("c", python="3.11.2")], "links": []})
    assert [(p["code"], p["severity"], p["nodes"]) for p in patch] == [("python_patch_differs", "warning", ["c"])]
    assert blocking_problems({"problems": patch}) == []


def test_unreachable_node_is_blocking_and_others_still_judged():
    nodes = [node("a"), node("b", torch=None), {"name": "c", "host": "10.0.0.3", "reachable": False,
                                                 "error": "c: cannot connect to 10.0.0.3:22: timed out after 10 s"}]
    probs = find_problems({"nodes": nodes, "links": full_mesh("ab")})
    assert codes(probs) == ["node_unreachable", "torch_missing"]
    unreachable = next(p for p in probs if p["code"] == "node_unreachable")
    assert unreachable["nodes"] == ["c"] and "timed out" in unreachable["message"]
    assert codes(blocking_problems({"problems": probs})) == ["node_unreachable", "torch_missing"]


def test_python_that_cannot_run_is_its_own_error():
    nodes = [node("a"), {"name": "b", "host": "h", "reachable": False, "python_error": True,
                         "error": "python '/nope' cannot be run there (exit 127)"}]
    (p,) = find_problems({"nodes": nodes, "links": []})
    assert p["code"] == "python_unusable" and "python:" in p["fix"]


def test_bandwidth_far_below_advertised():
    links = full_mesh("ab")
    links[0]["bandwidth_mbit"] = 300.0  # a -> b; advertised 1000 on both
    probs = find_problems({"nodes": [node("a"), node("b")], "links": links})
    below = [p for p in probs if p["code"] == "bandwidth_below_advertised"]
    assert len(below) == 1 and "300 Mbit/s measured, 1000 Mbit/s advertised" in below[0]["message"]
    # The slower end's advertised rate is the reference: 300 of min(1000, 400) is fine.
    probs = find_problems({"nodes": [node("a"), node("b", advertised_bandwidth_mbit=400.0)],
                           "links": [link("a", "b", 300.0), link("b", "a", 300.0)]})
    assert "bandwidth_below_advertised" not in codes(probs)


def test_asymmetric_link_flagged_once_per_pair():
    links = [link("a", "b", 900.0), link("b", "a", 400.0)]
    probs = [p for p in find_problems({"nodes": [node("a"), node("b")], "links": links}, Thresholds(bandwidth_ratio=0.1))
             if p["code"] == "asymmetric_link"]
    assert len(probs) == 1 and probs[0]["nodes"] == ["a", "b"]
    links = [link("a", "b", 900.0), link("b", "a", 800.0)]
    assert "asymmetric_link" not in codes(find_problems({"nodes": [node("a"), node("b")], "links": links}))


def test_rtt_threshold_is_configurable():
    probe = {"nodes": [node("a"), node("b")], "links": full_mesh("ab", bw=950.0, rtt=0.5)}
    probe["links"] = [link("a", "b", 1.0, 35.0), link("b", "a", 1.0, 35.0)]
    t = Thresholds(bandwidth_ratio=0.0)
    high = [p for p in find_problems(probe, t) if p["code"] == "high_rtt"]
    assert len(high) == 1 and "35.0 ms" in high[0]["message"]
    assert not [p for p in find_problems(probe, Thresholds(rtt_ms=50, bandwidth_ratio=0.0)) if p["code"] == "high_rtt"]


def test_tcp_buffers_below_bandwidth_delay_product():
    # 1 Gbit/s x 80 ms = 10 MB in flight: the default 6 MB tcp_rmem and 4 MB tcp_wmem are too small.
    probe = {"nodes": [node("a"), node("b")], "links": full_mesh("ab", bw=950.0, rtt=80.0)}
    probs = [p for p in find_problems(probe, Thresholds(rtt_ms=1000)) if p["code"] == "tcp_buffer_small"]
    flagged = {(p["nodes"][0], p["message"].split()[1]) for p in probs}
    assert flagged == {(n, k) for n in "ab" for k in ("net.core.rmem_max", "net.core.wmem_max",
                                                      "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")}
    rmem = next(p for p in probs if p["nodes"] == ["b"] and "tcp_rmem" in p["message"])
    assert "10.00 MB" in rmem["message"] and "16777216" in rmem["fix"]  # next power of two above the BDP
    # Same link at 1 ms: 125 kB in flight; only the 212 kB core limits are... still above it: quiet.
    quiet = {"nodes": [node("a"), node("b")], "links": full_mesh("ab", bw=950.0, rtt=1.0)}
    assert "tcp_buffer_small" not in codes(find_problems(quiet))
    # Big enough buffers: quiet even on the long link.
    big = dict(TCP_DEFAULT, rmem_max=1 << 25, wmem_max=1 << 25, tcp_rmem=[4096, 131072, 1 << 25],
               tcp_wmem=[4096, 16384, 1 << 25])
    tuned = {"nodes": [node("a", tcp=big), node("b", tcp=big)], "links": full_mesh("ab", bw=950.0, rtt=80.0)}
    assert "tcp_buffer_small" not in codes(find_problems(tuned, Thresholds(rtt_ms=1000)))


def test_advertised_rate_counts_when_buffers_hold_the_measured_one_back():
    # Measured 100 Mbit/s because of small buffers; advertised 1 Gbit/s is what they must cover.
    probe = {"nodes": [node("a"), node("b")], "links": full_mesh("ab", bw=100.0, rtt=80.0)}
    assert "tcp_buffer_small" in codes(find_problems(probe, Thresholds(rtt_ms=1000, bandwidth_ratio=0.0)))


def test_slow_disk_low_memory_clock_skew_cpu_limit():
    nodes = [node("a"), node("b", disk_read_mb_s=40.0, memory_bytes=2 * 2**30, clock_offset_s=3.5,
                                cpu_share=0.45, cpu_count=2)]
    probs = find_problems({"nodes": nodes, "links": []})
    assert codes(probs) == ["clock_skew", "cpu_limited", "low_memory", "slow_disk"]
    assert all(p["nodes"] == ["b"] for p in probs)
    assert [p["severity"] for p in probs] == ["warning", "warning", "warning", "info"]  # sorted by severity
    assert blocking_problems({"problems": probs}) == []


def test_failed_link_and_failed_sweep():
    links = [link("a", "b"), {"src": "b", "dst": "a", "bandwidth_mbit": None, "rtt_ms": None,
                              "error": "b cannot reach a: connection refused"}]
    probe = {"nodes": [node("a"), node("b")], "links": links,
             "collectives": [{"op": "all_reduce", "nodes": ["a", "b"], "error": "a: timed out"}]}
    probs = find_problems(probe)
    assert codes(probs) == ["collective_failed", "link_failed"]
    assert codes(blocking_problems({"problems": probs})) == ["link_failed"]
