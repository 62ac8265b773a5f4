"""VPSC_TESTS_REQUIRE_SANDBOX=1 turns a skipping sandbox/SSH test into a failure (CI); unset, it skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

@pytest.mark.sandbox
def test_sandbox_needs_root():
    pytest.skip("sandbox unavailable: needs root")

@pytest.mark.ssh
@pytest.mark.skipif(True, reason="needs root to run a throwaway sshd")
def test_ssh_needs_sshd():
    pass

def test_plain_skip_stays_a_skip():
    pytest.skip("not applicable here")

@pytest.mark.sandbox
@pytest.mark.xfail(reason="known")
def test_xfail_untouched():
    assert False

@pytest.mark.sandbox
def test_passes():
    pass
'''


@pytest.mark.parametrize("required", ["1", ""])
def test_skips_of_sandbox_and_ssh_tests_fail_when_required(tmp_path, required):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "VPSC_TESTS_REQUIRE_SANDBOX": required, "PYTHONPATH": str(TESTS)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "strict_skips", "-p", "no:cacheprovider", "-rA", "-q",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_sample.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    tail = r.stdout.strip().splitlines()[-1]
    if required:
        assert r.returncode == 1, r.stdout
        # A skip during setup (skipif, a fixture giving up) is reported as an error: failing all the same.
        assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in tail, r.stdout
        assert "VPSC_TESTS_REQUIRE_SANDBOX=1 and this sandbox test skipped: sandbox unavailable: needs root" in r.stdout
        assert "this ssh test skipped: needs root to run a throwaway sshd" in r.stdout
    else:
        assert r.returncode == 0, r.stdout
        assert "1 passed, 3 skipped, 1 xfailed" in tail, r.stdout
