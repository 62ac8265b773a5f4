"""The exporter benchmark's arithmetic: the cost in % of tokens/s and the noise floor beside it.
(The benchmark itself runs in a sandbox with a real Prometheus: `vpscluster bench exporters`.)"""

from __future__ import annotations

import pytest

from vpscluster.bench.exporters import ExporterSettings, markdown, run_exporters, summarize
from vpscluster.errors import UserError


def test_cost_and_spread_from_abba_runs():
    rows = [{"run": "01", "exporters": "on", "tokens_per_s": 990.0}, {"run": "02", "exporters": "off", "tokens_per_s": 1000.0},
            {"run": "03", "exporters": "off", "tokens_per_s": 1010.0}, {"run": "04", "exporters": "on", "tokens_per_s": 1000.0},
            {"run": "05", "exporters": "off", "failed": "boom"}]
    sm = summarize(rows)
    assert sm["runs_on"] == 2 and sm["runs_off"] == 2  # the failed run counts on neither side
    assert sm["tokens_per_s_on"] == pytest.approx(995.0) and sm["tokens_per_s_off"] == pytest.approx(1005.0)
    assert sm["cost_pct"] == pytest.approx(100 * 10 / 1005)
    assert sm["spread_on_pct"] == pytest.approx(100 * 10 / 995)
    text = markdown(rows, sm)
    assert "| 05 (failed) | off |" in text and "tokens/s: with exporters 995.0, without 1005.0: cost +1.00%" in text


def test_the_steady_figure_is_summarised_the_same_way():
    rows = [{"exporters": "on", "tokens_per_s": 900.0, "steady_tokens_per_s": 1000.0},
            {"exporters": "off", "tokens_per_s": 1000.0, "steady_tokens_per_s": 1002.0},
            {"exporters": "off", "tokens_per_s": 1000.0, "steady_tokens_per_s": None}]
    sm = summarize(rows, "steady_tokens_per_s")
    assert sm["runs_off"] == 1 and sm["cost_pct"] == pytest.approx(100 * 2 / 1002)
    assert "2nd half: with exporters 1000.0, without 1002.0" in markdown(rows, summarize(rows), sm)


def test_one_side_missing_gives_no_cost():
    assert "cost_pct" not in summarize([{"exporters": "on", "tokens_per_s": 5.0}])


def test_bad_settings_are_refused_before_any_sandbox():
    with pytest.raises(UserError, match="--pairs"):
        run_exporters(ExporterSettings(pairs=0))
