"""`--strategy auto` for a user's script: the pure choice on measured figures
(`train.strategies.sync_rule.choose_measured`) and the module the session hands back (`session.auto.Switchable`).
The choice on real ranks: tests/test_run_session.py."""

from __future__ import annotations


import pytest

from vpscluster.train.strategies import sync_rule
from vpscluster.train.strategies.sync_rule import choose_measured

P = 1_000_000  # parameters
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def test_ddp_stays_where_its_communication_is_a_small_share_of_the_step():
    settings, reason = choose_measured(0.200, 0.004, P, 4, 10_000 * MBIT)
    assert settings == {"name": "ddp"} and reason.startswith("ddp: ") and "2% of a step" in reason


def test_a_slow_link_gets_diloco_with_the_sync_rules_h_and_wire_on_the_measured_step():
    step_s, bw = 0.050, 100 * MBIT
    settings, reason = choose_measured(step_s, 0.150, 10 * P, 4, bw, overlap_steps=1)
    rule = sync_rule.choose_sync(bw, step_s, 10 * P, 4, overlap_steps=1)
    assert settings == {"name": "diloco", "compress": "none", **rule.settings()}
    assert settings["wire_dtype"] == "int8" and settings["sync_every"] >= sync_rule.H_MIN
    assert reason.startswith(f"diloco H={rule.sync_every} int8: ") and "75% of a DDP step" in reason


def test_an_egress_quota_that_ddp_would_use_up_gets_diloco_even_on_a_fast_link():
    # DDP: 8 MB per rank per 1 s step, 100 GB/month per rank allows ~0.04 MB per second.
    quota = sync_rule.EgressBudget(((100e9, 30 * 86400.0),))
    settings, reason = choose_measured(1.0, 0.01, 2 * P, 2, 10_000 * MBIT, egress=quota, ddp_bytes_per_step=8e6)
    assert settings["name"] == "diloco" and "over the egress quota" in reason
    assert sync_rule.sync_bytes(2 * P, 2, settings["wire_dtype"]) / settings["sync_every"] <= quota.per_step(1.0) * 1.01 \
        or "quota runs out" in reason
    # Without the quota the same figures keep DDP.
    assert choose_measured(1.0, 0.01, 2 * P, 2, 10_000 * MBIT, ddp_bytes_per_step=8e6)[0] == {"name": "ddp"}


def test_one_rank_is_plain_ddp():
    assert choose_measured(0.1, 5.0, P, 1, 1 * MBIT)[0] == {"name": "ddp"}


def test_the_switchable_module_keeps_parameters_and_attributes_and_follows_the_active_wrapper():
    import torch

    from vpscluster.session.auto import Switchable

    model = torch.nn.Linear(3, 2)
    model.config = {"hidden": 3}
    calls = []

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append("wrapper")
            return self.inner(x)

    m = Switchable(model, Wrapper(model))
    assert [id(p) for p in m.parameters()] == [id(p) for p in model.parameters()]
    assert m.config == {"hidden": 3} and m.in_features == 3
    x = torch.ones(1, 3)
    assert torch.equal(m(x), model(x)) and calls == ["wrapper"]
    object.__setattr__(m, "_active", model)  # what session.auto.switch does
    m(x)
    assert calls == ["wrapper"]
    m.eval()
    assert not model.training


def test_the_launcher_hands_the_cluster_files_quotas_and_links_to_the_session(tmp_path):
    """`run --cluster FILE --strategy auto`: session.json's `auto` holds each node's egress quota
    per rank and the ring's bandwidth, from the cluster file as `train`'s plan reads them."""
    from vpscluster.cluster.inventory import load_cluster
    from vpscluster.launch.run import auto_inputs

    (tmp_path / "cluster.yaml").write_text(
        "nodes:\n" + "".join(f"  - {{name: n{i}, host: 10.0.0.{i + 1}, advertised_bandwidth: 100mbit, egress_quota: 1TB/month}}\n"
                             for i in range(3)))
    cluster = load_cluster(str(tmp_path / "cluster.yaml"))
    got = auto_inputs(cluster)
    assert got.egress_quotas and all(b == pytest.approx(1e12) for b, _ in got.egress_quotas)
    assert got.bandwidth_bytes_s == pytest.approx(100 * MBIT, rel=0.2) and got.source == "the cluster file's bandwidths"
