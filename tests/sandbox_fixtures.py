"""Fixtures that bring an emulated cluster (vpscluster sandbox) up and down around tests.

    def test_something(make_sandbox):
        info = make_sandbox(nodes=3, bandwidth="100mbit", cpu=0.45)   # a SandboxInfo
        ... info.cluster_file, info.nodes[0].address, info.nodes[0].namespace ...

Every sandbox gets a unique name starting with TEST_PREFIX and is brought down at teardown,
also when the test fails (and `up` cleans up after itself when it fails half-way); a run killed
half-way is cleaned with `vpscluster sandbox down --prefix TEST_PREFIX`, which touches no other
sandbox. TEST_PREFIX is `pt-`, or $VPSC_TEST_SANDBOX_PREFIX (CI sets one per run, so two runs on
one machine never remove each other's). `sandbox3` is one 3-node sandbox shared by a test
module, `shared2` one 2-node sandbox shared by the modules that only launch runs on it. Where a sandbox cannot be built (not root, tools or cgroups missing) the test is skipped
with the exact reason, never silently (and fails instead under VPSC_TESTS_REQUIRE_SANDBOX=1, see
conftest.py).

Helpers for tests: `ssh_run(info, node, command)` logs in to a node with the sandbox's key and
known_hosts (strict host-key checking), `ns_popen(info, node, argv)` starts a process directly
inside a node's network namespace and CPU cgroup.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Sequence

import pytest

TEST_PREFIX = os.environ.get("VPSC_TEST_SANDBOX_PREFIX") or "pt-"


def sandbox_unavailable_reason() -> str | None:
    """Why no sandbox can be built here (one line), or None."""
    from vpscluster.cluster.sandbox import cgroup
    from vpscluster.cluster.sandbox.system import missing_requirements

    why = missing_requirements()
    if why:
        return why
    return cgroup.unavailable_reason()


class SandboxFactory:
    """Brings sandboxes up with unique names and remembers them, so `close()` brings all down."""

    def __init__(self, kind: str = ""):
        self.prefix = f"{TEST_PREFIX}{kind}"
        self.names: list[str] = []

    def __call__(self, nodes: int | None = 3, bandwidth="100mbit", cpu=None, latency_ms: float | None = None,
                 name: str | None = None, **options):
        from vpscluster.cluster import sandbox

        why = sandbox_unavailable_reason()
        if why:
            pytest.skip(f"sandbox unavailable: {why}")
        name = name or f"{self.prefix}{secrets.token_hex(3)}"
        self.names.append(name)  # before up: teardown covers a half-finished up too
        return sandbox.up(name, nodes=nodes, bandwidth=bandwidth, cpu=cpu, latency_ms=latency_ms, **options)

    def close(self) -> None:
        from vpscluster.cluster import sandbox

        errors = []
        for name in reversed(self.names):
            try:
                sandbox.down(name)
            except Exception as e:  # try every sandbox before reporting
                errors.append(f"{name}: {e}")
        self.names.clear()
        if errors:
            raise RuntimeError("sandbox teardown failed: " + "; ".join(errors))


@pytest.fixture
def make_sandbox():
    """Factory: make_sandbox(nodes=3, bandwidth="100mbit", cpu=None, latency_ms=None) -> SandboxInfo."""
    factory = SandboxFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def sandbox3():
    """One 3-node sandbox at 100 Mbit/s, unlimited CPU, shared by the tests of a module."""
    factory = SandboxFactory(kind="m-")
    try:
        yield factory(nodes=3, bandwidth="100mbit")
    finally:
        factory.close()


@pytest.fixture(scope="session")
def shared2():
    """One 2-node sandbox at 1 Gbit/s, unlimited CPU, shared by the modules whose tests only launch
    runs on it and leave it as they found it (no faults, no firewall, no changed node, nothing
    left running): the quick probe its first launch takes is saved beside its cluster file and
    serves every later launch of the session, as it serves a user's next run, instead of one
    sandbox and one probe per module."""
    factory = SandboxFactory(kind="s2-")
    try:
        yield factory(nodes=2, bandwidth="1gbit")
    finally:
        factory.close()


def cluster_file_with(info, path, **settings) -> Path:
    """A copy of the sandbox's cluster file at `path` (the file itself when `path` is it) with
    top-level `settings` changed, e.g. `connect_timeout_s=5`: a test's shorter waits, set through
    the file's own keys."""
    import yaml

    doc = yaml.safe_load(Path(info.cluster_file).read_text())
    path = Path(path)
    path.write_text(yaml.safe_dump({**doc, **settings}, sort_keys=False))
    return path


def ssh_run(info, node: str, command: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """Run `command` on sandbox node `node` through ssh, as a real remote command."""
    from vpscluster.cluster.sandbox import ssh_command

    return subprocess.run(ssh_command(info, info.node(node), command), capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def ns_popen(info, node: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Start `argv` inside node `node`'s network namespace and CPU cgroup (no ssh in between)."""
    from vpscluster.cluster.sandbox.cgroup import enter_argv

    n = info.node(node)
    return subprocess.Popen(enter_argv(n.cgroup, n.namespace, argv), **kwargs)


def node_run_dir(node, run_dir) -> Path:
    """A `train` run's folder on a sandbox node: runs/<the local folder's name>-<its run_uid>
    (`rundir.node_name`), read from the local run's config.yaml."""
    import yaml

    from vpscluster.train import rundir

    uid = yaml.safe_load((Path(run_dir) / rundir.CONFIG).read_text()).get("run_uid") or ""
    return Path(node.workdir, "runs", rundir.node_name(run_dir, uid))


def iperf3_mbit(info, src: str, dst: str, port: int = 5201, seconds: float = 3, omit: float = 1) -> float:
    """iperf3's receiver-side goodput src -> dst in Mbit/s (`omit` s of slow start left out).

    The server keeps listening until the end, and the client is tried again until it reports a
    result: it fails fast while the server is not listening yet, and a test cut short on a busy
    machine comes back with an "error" and no `sum_received`."""
    import json
    import time

    server = ns_popen(info, dst, ["iperf3", "-s", "-B", info.node(dst).address, "-p", str(port)],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            client = ns_popen(info, src, ["iperf3", "-c", info.node(dst).address, "-p", str(port), "-t", str(seconds),
                                          "-O", str(omit), "-J", "--connect-timeout", "2000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = client.communicate(timeout=seconds + omit + 20)
            except subprocess.TimeoutExpired:
                client.kill()
                client.communicate()
                raise AssertionError(f"iperf3 {src} -> {dst} did not finish") from None
            doc = json.loads(out) if out.strip().startswith("{") else {}
            received = doc.get("end", {}).get("sum_received")
            if client.returncode == 0 and received:
                return received["bits_per_second"] / 1e6
            if time.monotonic() > deadline:
                raise AssertionError(f"iperf3 {src} -> {dst} failed: {doc.get('error') or err.strip() or out[-300:]}")
            time.sleep(0.2)
    finally:
        server.kill()
        server.wait(timeout=10)


def cmdline(pid: int) -> str:
    """A process's command line, words joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
