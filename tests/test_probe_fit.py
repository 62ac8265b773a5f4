"""The α–β (Hockney) fit and the nccl-tests bandwidth conventions of the sweep summary."""

import random

import pytest

from vpscluster.probe.collectives import DEFAULT_SIZES, fit_alpha_beta, summarize


def test_fit_recovers_alpha_beta_exactly():
    alpha, beta = 2.5e-3, 12.5e6  # 2.5 ms, 100 Mbit/s
    times = [alpha + m / beta for m in DEFAULT_SIZES]
    a, b = fit_alpha_beta(DEFAULT_SIZES, times)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)


def test_fit_with_noise_stays_close():
    rng = random.Random(7)
    alpha, beta = 0.8e-3, 1.2e9
    times = [(alpha + m / beta) * (1 + rng.uniform(-0.05, 0.05)) for m in DEFAULT_SIZES]
    a, b = fit_alpha_beta(DEFAULT_SIZES, times)
    assert a == pytest.approx(alpha, rel=0.15) and b == pytest.approx(beta, rel=0.15)


def test_fit_never_returns_negative_latency():
    # Pure bandwidth data with noise that would pull α below zero.
    sizes = [1e3, 1e6, 1e7]
    times = [0.9e-6, 1.0e-3, 1.0e-2]
    a, b = fit_alpha_beta(sizes, times)
    assert a == 0.0 and b == pytest.approx(1e9, rel=0.1)


def test_fit_falls_back_to_bandwidth_when_time_shrinks_with_size():
    # Loopback noise: the small sizes took longer than the large one, so the free fit's slope
    # is negative (alpha positive). The bandwidth is then fitted alone, never reported as None.
    sizes = [1e3, 1e4, 1e5]
    times = [3e-4, 2e-4, 1e-4]
    a, b = fit_alpha_beta(sizes, times)
    assert a == 0.0 and b is not None and b > 0
    w = [1 / t**2 for t in times]
    slope = sum(wi * m * t for wi, m, t in zip(w, sizes, times)) / sum(wi * m * m for wi, m in zip(w, sizes))
    assert b == pytest.approx(1 / slope)
    row = summarize({"world_size": 2, "backend": "gloo",
                     "results": [{"size_bytes": m, "time_s": t, "iters": 5, "correct": True} for m, t in zip(sizes, times)]},
                    ["a", "b"])
    assert row["beta_bytes_per_s"] == pytest.approx(b) and row["bus_beta_bytes_per_s"] == pytest.approx(b)


def test_fit_flat_times_still_give_a_bandwidth():
    # Equal times at every size: the free fit's slope is exactly zero.
    a, b = fit_alpha_beta([1e3, 1e6], [1e-3, 1e-3])
    assert a == 0.0 and b is not None and b > 0


def test_fit_single_point_and_empty():
    a, b = fit_alpha_beta([1e6], [1e-3])
    assert a == 0.0 and b == pytest.approx(1e9)
    with pytest.raises(ValueError):
        fit_alpha_beta([], [])


def test_summary_busbw_follows_nccl_tests():
    raw = {"backend": "gloo", "world_size": 4, "results": [
        {"size_bytes": 1 << 20, "iters": 10, "time_s": 0.1, "correct": True},
        {"size_bytes": 1 << 24, "iters": 2, "time_s": 1.5, "correct": True}]}
    s = summarize(raw, ["a", "b", "c", "d"])
    r = s["results"][1]
    assert r["algbw_bytes_per_s"] == pytest.approx((1 << 24) / 1.5)
    assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * 2 * 3 / 4)
    assert s["bus_beta_bytes_per_s"] == pytest.approx(s["beta_bytes_per_s"] * 1.5)
    assert s["op"] == "all_reduce" and s["world_size"] == 4 and "error" not in s


def test_summary_reports_wrong_sums_as_error():
    raw = {"backend": "gloo", "world_size": 2, "results": [
        {"size_bytes": 4096, "iters": 5, "time_s": 1e-3, "correct": False}]}
    assert "wrong sums" in summarize(raw, ["a", "b"])["error"]


def test_fit_takes_the_bandwidth_from_the_large_messages():
    # A 4-node sweep measured in the sandbox (100 Mbit/s tbf links, 0.45-core nodes): the 64 KB
    # all-reduce rode the token bucket's burst and the small ones waited on the CPU quota. One
    # relative-error fit over all sizes put the bus rate at 101.5 Mbit/s, above the link; the
    # large messages alone say ~93, as the 16 MB one ran.
    sizes = [4096, 16384, 65536, 262144, 1048576, 4194304, 16777216]
    times = [0.01171, 0.0107, 0.01003, 0.04113, 0.15046, 0.55798, 2.17125]
    row = summarize({"world_size": 4, "backend": "gloo",
                     "results": [{"size_bytes": m, "time_s": t, "iters": 5, "correct": True} for m, t in zip(sizes, times)]},
                    list("abcd"))
    bus_mbit = row["bus_beta_bytes_per_s"] * 8 / 1e6
    largest = row["results"][-1]["busbw_mbit"]
    assert largest <= bus_mbit < 100, (bus_mbit, largest)
    assert bus_mbit == pytest.approx(largest, rel=0.03)
    assert 0.005 < row["alpha_s"] < 0.012  # the small messages' ~10 ms still set the latency
