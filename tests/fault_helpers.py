"""Helpers shared by the failure tests (faults, guard, hung nodes, full disks)."""

from __future__ import annotations

import os
import secrets


def sandbox_name() -> str:
    """A unique sandbox name: the test run's prefix (VPSC_TEST_SANDBOX_PREFIX) or `ft-`, so these
    tests' sandboxes are told apart from (and never removed with) anyone else's."""
    return f"{os.environ.get('VPSC_TEST_SANDBOX_PREFIX') or 'ft-'}{secrets.token_hex(3)}"
