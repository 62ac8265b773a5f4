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
    # A whole core per node (the benchmark's default is 0.45): the rows' figures are not checked
    # here, and torch's start on every launch, pre-flight's probe and the rows' steps take half the time.
    proc = cli("bench", "wan", "--nodes", "2", "--cpu", "1", "--preset", "tiny", "--budget-s", "6", "--sync-every", "4",
               "--strategies", "baseline", "--row", "dl-int8=--strategy diloco --sync-every 4 --wire-dtype int8",
               "--ddp-eval-every", "2", "--name", f"{TEST_PREFIX}tbw",
               "--targets", "baseline@0.5,baseline@1,ideal@1", "--out", str(tmp_path / "out"), "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert set(rows) == {"baseline", "dl-int8"}  # a row of one's own flags (--row) beside the baseline
    for r in rows.values():
        assert r["steps"] >= 1 and r["iface_mb_per_node"] > 0 and r["final_val_loss"] > 0
    assert rows["dl-int8"]["counted_mb_per_node"] > 0
    assert doc["scenario"]["rows"] == {"dl-int8": ["--strategy", "diloco", "--sync-every", "4", "--wire-dtype", "int8"]}
    assert rows["baseline"]["counted_mb_per_node"] is None
    assert doc["scenario"]["warmup_steps"] == 20  # the trainer's schedule for every row
    # The time-to-target table (the ideal row's end to end run is in the smoke run of the report;
    # its links are tested by test_unthrottled_...): the baseline's targets, ideal's absent.
    assert [t["name"] for t in doc["targets"]] == ["baseline@0.5", "baseline@1", "ideal@1"]
    assert doc["targets"][1]["val_loss"] == rows["baseline"]["final_val_loss"] and doc["targets"][2]["val_loss"] is None
    targets = {r["strategy"]: r for r in doc["time_to_target"]}
    assert targets["baseline"]["t1_vs_baseline"] == 1.0 and targets["dl-int8"]["ran_as"] == "diloco"
    text = (tmp_path / "out" / "table.md").read_text()
    assert text.startswith("| strategy") and "→ baseline@1" in text and text.count("| dl-int8 |") == 3


# -- time to target (the long mode) ---------------------------------------------------------


def test_seconds_to_target_interpolates_the_first_crossing():
    from vpscluster.bench.wan import seconds_to_target

    assert seconds_to_target(EVALS, 4.0) == 10.0  # exactly at an evaluation
    assert seconds_to_target(EVALS, 3.5) == pytest.approx(15.0)  # half-way between 4.0 (10 s) and 3.0 (20 s)
    assert seconds_to_target(EVALS, 6.0) == 0.0  # already there at the first evaluation
    assert seconds_to_target(EVALS, 2.0) is None  # never reached
    # Not monotonic: the first crossing counts, not a later one.
    bumpy = EVALS + [{"tokens": 400, "seconds": 30.0, "val_loss": 3.6}, {"tokens": 500, "seconds": 40.0, "val_loss": 2.0}]
    assert seconds_to_target(bumpy, 3.0) == 20.0 and seconds_to_target(bumpy, 2.5) == pytest.approx(30 + 10 * 1.1 / 1.6)


def test_loss_at_seconds_interpolates_and_refuses_to_extrapolate():
    from vpscluster.bench.wan import loss_at_seconds

    assert loss_at_seconds(EVALS, 15.0) == pytest.approx(3.5)
    assert loss_at_seconds(EVALS, 20.0) == 3.0
    assert loss_at_seconds(EVALS, 21.0) is None


def test_parse_targets_and_its_one_line_error():
    from vpscluster.bench.wan import parse_targets
    from vpscluster.errors import UserError

    assert parse_targets("baseline@0.5, ideal@1") == [("baseline", 0.5), ("ideal", 1.0)]
    assert parse_targets("") == []
    for bad in ("baseline", "warp@0.5", "ideal@0", "ideal@1.5", "ideal@half"):
        with pytest.raises(UserError, match="STRATEGY@FRACTION"):
            parse_targets(bad)


def _run(evals, tokens, tx, tps, util=0.9, ran_as=None):
    return {"evals": evals, "tokens": tokens, "interface_tx_bytes": tx, "tokens_per_s": tps, "steps": len(evals) - 1,
            "compute_utilization": util, "final_val_loss": evals[-1]["val_loss"], "ran_as": ran_as}


def _curve(points):
    return [{"tokens": t, "seconds": s, "val_loss": v} for t, s, v in points]


def test_time_to_target_ratios_against_baseline_and_ideal_with_missing_targets():
    from vpscluster.bench.wan import target_legend, target_markdown, time_to_target

    runs = {
        # baseline: 5.0 -> 3.0 in 100 s; its loss after 50 s is 4.0.
        "baseline": _run(_curve([(0, 0, 5.0), (500, 50, 4.0), (1000, 100, 3.0)]), 1000, [5000, 5000], 10.0, 0.4),
        "ideal": _run(_curve([(0, 0, 5.0), (1000, 20, 3.0), (5000, 100, 2.0)]), 5000, [9000, 9000], 50.0, 1.0, "ddp"),
        # fast reaches 4.0 at 10 s and 3.0 at 40 s, never 2.0; 100x fewer bytes per token than the baseline.
        "fast": _run(_curve([(0, 0, 5.0), (1000, 10, 4.0), (4000, 40, 3.0), (6000, 60, 2.5)]), 6000, [300, 300], 100.0,
                     0.95, "diloco"),
    }
    rows, levels = time_to_target(runs, [("baseline", 0.5), ("baseline", 1.0), ("ideal", 1.0), ("ddp", 1.0)])
    assert [lv["val_loss"] for lv in levels] == [4.0, 3.0, 2.0, None]  # ddp did not run: no level
    assert levels[0]["ref_seconds"] == 50.0 and levels[0]["name"] == "baseline@0.5"
    base, ideal, fast = ({k: r for k, r in ((r["strategy"], r) for r in rows)}[n] for n in ("baseline", "ideal", "fast"))
    assert base["t0_s"] == 50.0 and base["t1_s"] == 100.0 and base["t0_vs_baseline"] == 1.0
    assert ideal["t0_s"] == 10.0 and ideal["t1_s"] == 20.0 and ideal["t2_s"] == 100.0
    assert fast["t0_s"] == 10.0 and fast["t0_vs_baseline"] == 5.0 and fast["t0_vs_ideal"] == 1.0
    assert fast["t1_s"] == 40.0 and fast["t1_vs_baseline"] == 2.5 and fast["t1_vs_ideal"] == 2.0
    assert fast["t2_s"] is None and fast["t2_vs_baseline"] is None and fast["t2_vs_ideal"] is None  # never reached
    assert base["t2_s"] is None and base["t2_vs_ideal"] is None
    assert all(r["t3_s"] is None and r["t3_vs_ideal"] is None for r in rows)  # a level that does not exist
    # Bytes per token: 10 (baseline), 0.1 (fast): 100x fewer.
    assert fast["iface_bytes_per_token"] == pytest.approx(0.1) and fast["bytes_per_token_reduction"] == pytest.approx(100.0)
    # Equal tokens vs ideal at min(final tokens): fast at 5000 tokens = 2.75 (between 3.0 @4000 and 2.5 @6000),
    # ideal at 5000 = 2.0: +37.5%; the baseline at its own 1000 tokens: 3.0 against ideal's 3.0.
    assert fast["equal_tokens"] == 5000 and fast["val_loss_at_equal_tokens"] == pytest.approx(2.75)
    assert fast["val_loss_vs_ideal_pct"] == pytest.approx(37.5)
    assert base["equal_tokens"] == 1000 and base["val_loss_vs_ideal_pct"] == pytest.approx(0.0)
    assert ideal["val_loss_vs_ideal_pct"] == 0.0
    figures, times = target_markdown(levels, rows + [{"strategy": "auto", "failed": "boom"}]).split("\n\n")
    assert len(figures.splitlines()) == len(times.splitlines()) == 2 + 4
    assert "| fast | diloco | 3 | 100 | 95% | 0 | 100.0x | 2.500 | 2.750 | +37.5% |" in figures
    assert times.splitlines()[0] == ("| strategy | → baseline@0.5 (4.000) | → baseline@1 (3.000) | → ideal@1 (2.000) "
                                     "| → ddp@1 (—) |")
    assert "| baseline | 50 s (1.00x / 5.00x) | 100 s (1.00x / 5.00x) | — | — |" in times
    assert "| fast | 10 s (5.00x / 1.00x) | 40 s (2.50x / 2.00x) | — | — |" in times
    assert "| ideal | 10 s (5.00x / 1.00x) | 20 s (5.00x / 1.00x) | 100 s (— / 1.00x) | — |" in times
    assert figures.splitlines()[-1].startswith("| auto (failed) |") and times.splitlines()[-1] == "| auto (failed) | — | — | — | — |"
    legend = target_legend(levels)
    assert "baseline@0.5 = 4.000 (baseline's val loss after 50 s" in legend and "ddp@1 = — (ddp did not run)" in legend


def test_time_to_target_without_ideal_or_baseline_leaves_those_columns_empty():
    from vpscluster.bench.wan import time_to_target

    runs = {"ddp": _run(_curve([(0, 0, 5.0), (100, 10, 4.0)]), 100, [10, 10], 10.0)}
    rows, levels = time_to_target(runs, [("ddp", 1.0), ("baseline", 0.5)])
    (row,) = rows
    assert row["t0_s"] == 10.0 and row["t0_vs_baseline"] is None and row["t0_vs_ideal"] is None
    assert row["val_loss_vs_ideal_pct"] is None and row["bytes_per_token_reduction"] is None
    assert levels[1]["val_loss"] is None


def test_settings_modes_and_the_trainers_schedule():
    from vpscluster.bench.wan import DEFAULT_TARGETS, LONG, QUICK, STRATEGIES, WanSettings
    from vpscluster.errors import UserError
    from vpscluster.train.config import TrainConfig

    short = WanSettings().resolved()
    assert short.budget_s == 150 and short.strategies.split(",") == list(STRATEGIES) and short.targets == ""
    assert {"ideal", "auto"} <= set(short.strategies.split(","))
    # Every run, the baseline included, gets the trainer's own warm-up and the preset's peak lr (not 5 steps).
    assert (short.warmup_steps, short.lr) == (TrainConfig().warmup_steps, TrainConfig(preset="small").peak_lr()) == (20, 2e-3)
    assert WanSettings(preset="tiny").resolved().lr == 3e-3 and WanSettings(lr=1e-3).resolved().lr == 1e-3
    long = WanSettings(long=True).resolved()
    assert long.budget_s == 900 and long.strategies == ",".join(LONG) and long.targets == DEFAULT_TARGETS
    assert long.ddp_eval_every == 5
    assert WanSettings(long=True, budget_s=30, strategies="baseline,auto").resolved().budget_s == 30
    quick = WanSettings(quick=True, budget_s=300).resolved()
    assert quick.strategies == ",".join(QUICK) and quick.budget_s == 60
    with pytest.raises(UserError, match="exclude"):
        WanSettings(quick=True, long=True).resolved()


def test_custom_rows_and_their_one_line_errors(cli):
    from vpscluster.bench.wan import custom_rows
    from vpscluster.errors import UserError

    assert custom_rows(["auto-lr1=--strategy auto --inner-lr-scale 1", "d5= --strategy diloco --sync-every '5'"]) == {
        "auto-lr1": ["--strategy", "auto", "--inner-lr-scale", "1"], "d5": ["--strategy", "diloco", "--sync-every", "5"]}
    for bad in ["auto=--strategy ddp", "x", "x=", "Big=--strategy ddp", "y=--lr 'unclosed"]:
        with pytest.raises(UserError, match="NAME='TRAIN FLAGS'"):
            custom_rows([bad])
    with pytest.raises(UserError, match="NAME='TRAIN FLAGS'"):
        custom_rows(["a=--strategy ddp", "a=--strategy diloco"])
    proc = cli("bench", "wan", "--row", "ideal=--strategy ddp", timeout=60)
    assert proc.returncode != 0 and "--row 'ideal=--strategy ddp'" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_targets_are_a_one_line_error(cli):
    proc = cli("bench", "wan", "--targets", "baseline@2", timeout=60)
    assert proc.returncode != 0
    assert "STRATEGY@FRACTION" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.sandbox
def test_unthrottled_removes_the_shaping_and_puts_it_back(make_sandbox):
    """The ideal row's links: no tc qdisc shaping either direction inside the block, the same
    rate again after it, also when the block fails."""
    from vpscluster.bench.wan import unthrottled
    from vpscluster.cluster.sandbox import shaping

    info = make_sandbox(nodes=2, bandwidth="50mbit")

    def qdiscs():
        return "\n".join(shaping.describe("eth0", n.namespace) + "\n" + shaping.describe(n.veth) for n in info.nodes)

    assert qdiscs().count("tbf") == 4
    said = []
    with pytest.raises(RuntimeError, match="inside"):
        with unthrottled(info, said.append):
            assert "tbf" not in qdiscs()
            raise RuntimeError("inside")
    assert qdiscs().count("tbf") == 4 and qdiscs().count("rate 50Mbit") == 4
    assert "unthrottled" in said[0] and "shaped again (50, 50 Mbit/s)" in said[-1]
