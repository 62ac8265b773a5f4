"""Running system tools (ip, tc, ssh-keygen, sshd) for the sandbox, each with a timeout.

Every call goes through `run_tool`, so a stuck tool never hangs `sandbox up` and a failing one
becomes a one-line `UserError` naming the command and what it said.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

from vpscluster.cluster.executor import last_words
from vpscluster.errors import UserError

# Tools the sandbox needs and the Debian package that has each.
REQUIRED_TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "ssh-keygen": "openssh-client",
    "unshare": "util-linux",
    "ssh": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}
SSHD = "/usr/sbin/sshd"


def run_tool(argv: Sequence[str], timeout_s: float = 15.0, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Run a system tool; raise UserError (one line) when it fails and `check` is set."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"sandbox: `{' '.join(argv)}` did not finish within {timeout_s:.0f} s") from None
    except FileNotFoundError:
        raise UserError(f"sandbox: {argv[0]} is not installed; install {REQUIRED_TOOLS.get(argv[0], argv[0])} (apt-get install ...)") from None
    if check and proc.returncode != 0:
        raise UserError(f"sandbox: `{' '.join(argv)}` failed: {last_words(proc.stderr, proc.stdout, proc.returncode)}")
    return proc


NOT_ROOT = "the sandbox needs root (network namespaces, tc, cgroups); run it as root, e.g. `sudo vpscluster sandbox up`"


def missing_requirements() -> str | None:
    """Why a sandbox cannot be built on this machine (one line), or None when it can."""
    if os.geteuid() != 0:
        return NOT_ROOT
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if not (shutil.which(tool) or os.access(tool, os.X_OK))})
    if missing:
        return f"the sandbox needs {', '.join(missing)}; install with `apt-get install {' '.join(missing)}`"
    if not os.path.isdir("/run/netns") and not os.access("/run", os.W_OK):
        return "the sandbox cannot create network namespaces here (/run is not writable)"
    return None


def require_root() -> None:
    """Enough for `down` and `status`: they must work even where sshd has since been removed."""
    if os.geteuid() != 0:
        raise UserError(NOT_ROOT)


def require_sandbox_support() -> None:
    why = missing_requirements()
    if why:
        raise UserError(why)
