"""`vpscluster bench wan`: the comparison arithmetic, and (sandbox) one tiny run end to end."""

from __future__ import annotations

import json

import pytest

from vpscluster.bench.wan import compare, evals_from_metrics, loss_at_tokens, markdown_table, seconds_to_loss

EVALS = [
    {"tokens": 0, "seconds": 0.0, "val_loss": 5.0},
    {"tokens": 100, "seconds": 10.0, "val_loss": 4.0},
    {"tokens": 300, "seconds": 20.0, "val_loss": 3.0},
]


def test_loss_at_tokens_interpolates_and_refuses_to_extrapolate():
    assert loss_at_tokens(EVALS, 100) == 4.0
    assert loss_at_tokens(EVALS, 200) == pytest.approx(3.5)
    assert loss_at_tokens(EVALS, 301) is None


def test_seconds_to_loss_is_the_first_evaluation_at_or_below():
    assert seconds_to_loss(EVALS, 4.0) == 10.0
    assert seconds_to_loss(EVALS, 3.5) == 20.0
    assert seconds_to_loss(EVALS, 2.0) is None


def test_evals_from_metrics_accumulates_tokens_and_step_seconds(tmp_path):
    lines = [{"step": 0, "val_loss": 5.5}]
    for step in (1, 2, 3, 4):
        lines.append({"step": step, "loss": 5.0, "step_seconds": 2.0, "tokens": 1000, "compute_seconds": 1.0,
                      "comm_seconds": 1.0, "bytes_sent": 0})
        if step % 2 == 0:
            lines.append({"step": step, "val_loss": 5.0 - step / 10})
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    assert evals_from_metrics(path) == [
        {"tokens": 0, "seconds": 0.0, "val_loss": 5.5},
        {"tokens": 2000, "seconds": 4.0, "val_loss": 4.8},
        {"tokens": 4000, "seconds": 8.0, "val_loss": 4.6},
    ]


def test_compare_relates_every_strategy_to_the_baseline():
    runs = {
        "baseline": {"tokens": 300, "final_val_loss": 3.0, "evals": EVALS, "interface_tx_bytes": [3000, 3000],
                     "strategy_bytes_sent": None, "steps": 3, "tokens_per_s": 15.0, "compute_utilization": 0.3},
        "fast": {"tokens": 900, "final_val_loss": 2.0, "interface_tx_bytes": [30, 30], "strategy_bytes_sent": [20, 20],
                 "steps": 9, "tokens_per_s": 45.0, "compute_utilization": 0.95,
                 "evals": [{"tokens": 0, "seconds": 0.0, "val_loss": 5.0}, {"tokens": 600, "seconds": 5.0, "val_loss": 2.9},
                           {"tokens": 900, "seconds": 8.0, "val_loss": 2.0}]},
    }
    base, fast = compare(runs)
    assert base["speedup_to_baseline_loss"] == 1.0 and base["val_loss_vs_baseline_pct"] == 0.0
    assert fast["seconds_to_baseline_loss"] == 5.0 and fast["speedup_to_baseline_loss"] == 4.0
    # 6000 B / 300 tokens against 60 B / 900 tokens: 300x fewer bytes per token.
    assert fast["bytes_per_token_reduction"] == pytest.approx(300.0)
    assert fast["iface_mb_per_node"] == 30 / 1e6 and fast["counted_mb_per_node"] == 20 / 1e6
    assert fast["val_loss_at_baseline_tokens"] == pytest.approx(5.0 - 2.1 * 300 / 600)
    table = markdown_table([base, fast])
    assert table.count("\n") == 3 and "| fast |" in table and "—" in table  # baseline counted no bytes


def test_bad_strategy_list_is_one_line_error(cli):
    proc = cli("bench", "wan", "--strategies", "ddp,warp", timeout=60)
    assert proc.returncode != 0
    assert "unknown warp" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.sandbox
@pytest.mark.slow
def test_bench_wan_runs_baseline_and_diloco_on_a_sandbox(cli, tmp_path):
    from sandbox_fixtures import TEST_PREFIX, sandbox_unavailable_reason

    why = sandbox_unavailable_reason()
    if why:
        pytest.skip(f"sandbox unavailable: {why}")
    proc = cli("bench", "wan", "--nodes", "2", "--preset", "tiny", "--budget-s", "6", "--sync-every", "4",
               "--strategies", "baseline,diloco-int8", "--ddp-eval-every", "2", "--name", f"{TEST_PREFIX}tbw",
               "--out", str(tmp_path / "out"), "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert set(rows) == {"baseline", "diloco-int8"}
    for r in rows.values():
        assert r["steps"] >= 1 and r["iface_mb_per_node"] > 0 and r["final_val_loss"] > 0
    assert rows["diloco-int8"]["counted_mb_per_node"] > 0
    assert rows["baseline"]["counted_mb_per_node"] is None
    assert (tmp_path / "out" / "table.md").read_text().startswith("| strategy")
