"""torchft's lighthouse: where the quorum engine's replica groups meet (`strategies/quorum_diloco.py`).

    lh = start_lighthouse("127.0.0.1", min_replicas=2)   # lh.address: http://127.0.0.1:PORT
    ...                                                   # replicas: TORCHFT_LIGHTHOUSE=lh.address
    lh.stop()

It runs torchft's own `torchft_lighthouse` (a Rust binary installed with torchft) as a child
process on the head, bound to `host`; `start_lighthouse` waits until it accepts connections
(`timeout_s`) and otherwise raises one line with the end of its output.

What the lighthouse does: every replica group's Manager heartbeats to it; at each round's start
the Managers ask it for a quorum, which it grants once every heartbeating group has asked, or
once `min_replicas` have and `join_timeout_ms` has passed. A group whose heartbeats stop for
`heartbeat_timeout_ms` is left out of the next quorum: that, plus one failed reduction, is what
a dead node costs the survivors.

Its own failure: the replicas hold no connection to it between quorums, so the round in progress
finishes (reductions and commits do not involve it). The next quorum is asked of an address
that no longer answers: each replica fails after its `quorum_timeout_s` with one line naming the
lighthouse (`QuorumLost`) and exits non-zero; the launcher's relaunch path takes over from the
last checkpoint (tests/test_quorum_session.py). A lighthouse started again at the same address
does not rescue the running replicas with torchft 0.2.0: tried, their next quorum still timed
out (the Managers' lighthouse connection does not recover), so a new lighthouse belongs to the
relaunch, not to the running job.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vpscluster import procutil
from vpscluster.errors import UserError

BINARY = "torchft_lighthouse"


def lighthouse_binary() -> str:
    """The torchft_lighthouse next to this Python (a virtual environment's bin/), else on PATH."""
    here = Path(sys.executable).parent / BINARY
    found = str(here) if here.is_file() else shutil.which(BINARY)
    if not found:
        raise UserError(f"the quorum engine needs torchft's {BINARY}; pip install 'torchft==0.2.0' "
                        "into the Python that runs vpscluster")
    return found


@dataclass
class Lighthouse:
    host: str
    port: int
    argv: list[str]
    log: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        procutil.stop(self.proc, timeout_s)
        self.proc = None


def start_lighthouse(host: str, port: int = 0, min_replicas: int = 2, join_timeout_ms: int = 60000,
                     heartbeat_timeout_ms: int = 2000, timeout_s: float = 10.0, log: Path | None = None) -> Lighthouse:
    """The lighthouse listening on `host`:`port` (0: a free port), granting quorums of at least
    `min_replicas` replica groups. `join_timeout_ms` is long on purpose: a replica that still
    heartbeats is only slow (a loaded node), and a quorum formed without it would put it a round
    behind; a dead one is left out after `heartbeat_timeout_ms` whatever the join time-out. `log`: where its output goes (default: discarded unless it
    fails to start, when its end is in the error)."""
    if min_replicas < 1:
        raise UserError(f"the lighthouse needs min_replicas >= 1, got {min_replicas}")
    if not port:
        from vpscluster.nodeside.free_port import free_port

        port = free_port(host)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    argv = [lighthouse_binary(), "--bind", bind, "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    lh = Lighthouse(host, port, argv, log)
    _spawn(lh, timeout_s)
    return lh


def _spawn(lh: Lighthouse, timeout_s: float) -> None:
    import tempfile

    out = open(lh.log, "ab") if lh.log else tempfile.TemporaryFile()
    with out:
        lh.proc = subprocess.Popen(lh.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        deadline = time.monotonic() + timeout_s
        while True:
            if lh.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with status {lh.proc.returncode}" if lh.proc.poll() is not None \
                    else f"did not listen within {timeout_s:g} s"
                lh.stop()
                out.seek(0)
                tail = " ".join(out.read().decode(errors="replace").split())[-300:]
                raise UserError(f"the torchft lighthouse on {lh.host}:{lh.port} {why}: {tail or 'no output'}; "
                                "check that the address is this machine's and the port is free")
            try:
                with socket.create_connection((lh.host, lh.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
