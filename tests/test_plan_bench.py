"""`vpscluster bench plan`'s bookkeeping: error summary, table, and the BENCHMARKS.md section."""

from __future__ import annotations

import pytest

from vpscluster.bench import plan as bench
from vpscluster.errors import UserError


def row(pred_step, meas_step, pred_comm, meas_comm, strategy="ddp"):
    return {"scenario": "2n 100mbit cpu 0.5 tiny", "strategy": strategy,
            "predicted_step_s": pred_step, "measured_step_s": meas_step, "step_error": bench._err(pred_step, meas_step),
            "predicted_comm_s": pred_comm, "measured_comm_s": meas_comm, "comm_error": bench._err(pred_comm, meas_comm),
            "comm_error_of_step": abs(pred_comm - meas_comm) / meas_step}


def test_summary_is_median_and_max_of_absolute_relative_errors():
    rows = [row(1.1, 1.0, 0.5, 0.5), row(0.8, 1.0, 0.2, 0.4), row(2.0, 2.0, 1.0, 0.8)]
    s = bench.summarize(rows)
    assert s["configurations"] == 3
    assert s["step_error"]["median"] == pytest.approx(0.1) and s["step_error"]["max"] == pytest.approx(0.2)
    assert s["comm_error"]["median"] == pytest.approx(0.25) and s["comm_error"]["max"] == pytest.approx(0.5)


def test_scenarios_cover_the_issue_ranges():
    scen = bench.SCENARIOS
    assert sum(len(s.strategies) for s in scen) >= 12
    assert {s.nodes for s in scen} == {2, 3, 4}
    assert {s.model for s in scen} == {"tiny", "small"}
    rates = [r for s in scen for r in s.bandwidth.split(",")]
    assert "20mbit" in rates and "1gbit" in rates
    assert any("," in s.cpu for s in scen)  # uneven CPU shares
    shares = [float(c) for s in scen for c in s.cpu.split(",")]
    assert min(shares) >= 0.3 and max(shares) <= 0.9


def test_section_between_markers_is_replaced_and_nothing_else(tmp_path):
    f = tmp_path / "BENCHMARKS.md"
    f.write_text(f"# B\n\n<!-- section: wan -->\nwan text\n<!-- end: wan -->\n\n{bench.MARK_START}\nold\n{bench.MARK_END}\ntail\n")
    doc = {"rows": [row(1.1, 1.0, 0.5, 0.5)], "summary": bench.summarize([row(1.1, 1.0, 0.5, 0.5)]), "seconds": 60,
           "machine": "test", "command": "vpscluster bench plan", "steps": 8, "sync_every": 3}
    bench.write_benchmarks_section(f, bench.markdown(doc))
    text = f.read_text()
    assert "old" not in text and "wan text" in text and text.endswith(f"{bench.MARK_END}\ntail\n")
    assert "| 2n 100mbit cpu 0.5 tiny | ddp | 1.10 s | 1.00 s | 10% |" in text
    assert "median 10%, max 10%" in text
    f.write_text("no markers\n")
    with pytest.raises(UserError, match="markers"):
        bench.write_benchmarks_section(f, "x")


def test_missing_benchmarks_file_is_refused_before_any_sandbox(tmp_path):
    """Outside the project folder the bench says where BENCHMARKS.md should be, up front."""
    settings = bench.PlanBenchSettings(benchmarks=str(tmp_path / "BENCHMARKS.md"), results_dir=str(tmp_path / "r"))
    with pytest.raises(UserError, match="no such file to write the plan section into"):
        bench.run_plan_bench(settings)
    assert not (tmp_path / "r").exists()


def test_round_median_follows_the_mean_step_of_periodic_rounds():
    from vpscluster.bench.plan import round_median

    # DiLoCo H = 3: a send step and a landing step longer than the third; one round hit by a spike.
    steps = [3.0, 4.5, 2.2, 3.1, 4.4, 2.3, 9.0, 4.6, 2.2]
    assert round_median(steps, 3) == pytest.approx((3.1 + 4.4 + 2.3) / 3)
    assert round_median(steps, 1) == 3.1  # ddp: the median step
    assert round_median([1.0, 2.0], 3) == pytest.approx(1.5)  # fewer steps than a round: their mean
