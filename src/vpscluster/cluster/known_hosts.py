"""Host-key trust for SSH: verify against a known_hosts file; trust on first use only if asked.

OpenSSH's own rules, kept strict:
- a host listed in known_hosts must present a listed key (or a certificate from a listed CA);
- a host not listed is refused, unless the user explicitly accepts new keys, in which case the
  key is appended to known_hosts (OpenSSH format, `[host]:port` for ports other than 22) and
  every later connection is checked against it;
- a host whose key differs from the listed one is ALWAYS refused, with or without
  accept-new: that is what a man-in-the-middle looks like. The file is never rewritten.

`HostKeyCheck` is used once per connection attempt: `matcher` goes to asyncssh as its
`known_hosts` callable, `decide` is called by asyncssh for a key that matched nothing, and
`refusal()` words the error after asyncssh refused.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def host_pattern(host: str, port: int) -> str:
    """How OpenSSH names a host in known_hosts."""
    return host if port == 22 else f"[{host}]:{port}"


def _fingerprint(key) -> str:
    return f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"


# Appends from several executors of one process are serialised here; flock guards the rest.
_record_lock = asyncio.Lock()


class HostKeyCheck:
    """The trust decision for one node's host key."""

    def __init__(self, node_name: str, host: str, port: int, known_hosts: str | None, accept_new: bool) -> None:
        self.node_name = node_name
        self.host, self.port = host, port
        self.path = Path(known_hosts).expanduser() if known_hosts else Path("~/.ssh/known_hosts").expanduser()
        self.accept_new = accept_new
        self.listed_keys: list = []  # keys known_hosts holds for this host
        self.listed_cas: list = []
        self.offered_key = None  # the key the server showed us when it matched nothing
        self.verdict: str | None = None  # "unknown" | "changed" | "new-accepted"

    def matcher(self, host: str, addr: str, port: int | None):
        """asyncssh's known_hosts callable: the trusted, CA and revoked keys for this host."""
        import asyncssh

        empty = ((), (), (), (), (), (), ())
        if not self.path.is_file():
            return empty
        try:
            known = asyncssh.read_known_hosts(str(self.path))
        except (OSError, ValueError) as e:
            # An unreadable trust file must not turn into "no keys known" and then TOFU.
            self.accept_new = False
            self.verdict = f"unreadable: {getattr(e, 'strerror', None) or e}"
            return empty
        result = known.match(host, addr, port)
        self.listed_keys, self.listed_cas = list(result[0]), list(result[1])
        return result

    def decide(self, key) -> bool:
        """Called for a host key that matched no trusted key: accept only a new host on TOFU."""
        self.offered_key = key
        if self.verdict and self.verdict.startswith("unreadable"):
            return False
        if self.listed_keys or self.listed_cas:
            self.verdict = "changed"
            return False
        if self.accept_new:
            self.verdict = "new-accepted"
            return True
        self.verdict = "unknown"
        return False

    def refusal(self) -> str:
        """One line: why the host key was refused and what the user can do."""
        who = host_pattern(self.host, self.port)
        offered = _fingerprint(self.offered_key) if self.offered_key is not None else "a key"
        if self.verdict == "changed":
            listed = ", ".join(_fingerprint(k) for k in self.listed_keys) or "a certificate authority"
            return (f"{self.node_name}: HOST KEY CHANGED for {who}: {self.path} lists {listed} but the server "
                    f"now offers {offered}. Someone may be intercepting this connection (man-in-the-middle), or "
                    f"the server was reinstalled. Refusing to connect. If you know why it changed, remove the old "
                    f"entry (ssh-keygen -R '{who}' -f {self.path}) and connect again")
        if self.verdict and self.verdict.startswith("unreadable"):
            return f"{self.node_name}: cannot read known_hosts {self.path} ({self.verdict[12:]}); fix or remove that file"
        return (f"{self.node_name}: unknown host key for {who} ({offered}), not in {self.path}; pass "
                f"--accept-new-host-keys to trust it on first use, or add the host's key to that file")

    async def record(self) -> None:
        """Append the accepted new key to known_hosts (only for a host not listed at all)."""
        if self.verdict != "new-accepted" or self.offered_key is None:
            return
        algorithm, blob = self.offered_key.export_public_key("openssh").decode().split()[:2]
        line = f"{host_pattern(self.host, self.port)} {algorithm} {blob}\n"
        async with _record_lock:
            await asyncio.to_thread(_append_line, self.path, line)


def _append_line(path: Path, line: str) -> None:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        if line in text.splitlines(keepends=True):
            return  # another process recorded it meanwhile
        if text and not text.endswith("\n"):
            f.write("\n")
        f.write(line)
