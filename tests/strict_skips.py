"""VPSC_TESTS_REQUIRE_SANDBOX=1: a sandbox or SSH test that skips FAILS instead.

On a developer's laptop (not root, no sshd) those tests skip politely with the reason. CI runs
as root on a machine with every tool they need, so there a skip can only mean something broke
(a tool missing, a cgroup not mounted, a fixture that gave up): `.ci/run` turns this on, and the
suite cannot pass by skipping. Tests marked `sandbox`, `ssh` or `tools` (needs a binary the Makefile
installs: prometheus, chromium, a cgroup hierarchy) are covered; xfail is untouched.
"""

from __future__ import annotations

import os

import pytest

ENV = "VPSC_TESTS_REQUIRE_SANDBOX"
STRICT_MARKERS = ("sandbox", "ssh", "tools")


def required() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and required()) or hasattr(report, "wasxfail"):
        return
    marker = next((m for m in STRICT_MARKERS if item.get_closest_marker(m)), None)
    if marker is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"{ENV}=1 and this {marker} test skipped: {reason}"
