"""A sandbox node's "reboot" (`sandbox fault --node X reboot`), for nodes with their own root.

Sandbox nodes have no systemd; what a real node's boot would start is read from the node's own
disk instead and started the way systemd would, as a minimal init:

    shut down   every process of the node is killed (as `kill`; the listening sshd stays, so
                the node is reachable again at once), every network interface but lo and eth0
                is deleted (a TUN device goes with its process; a kernel one would stay), the
                nftables ruleset of its namespace is flushed, and its /run is emptied
    boot        the units the node enabled itself (links in its own /etc/systemd/system/*.wants/,
                i.e. the node's upper layer: the host's enabled units are the host's), sysinit
                ones first, then in their After= order; for each: Environment=, ExecStartPre=,
                ExecStart=, ExecStartPost= (a leading `-` ignores a failure), Type=oneshot runs
                them in turn, Type=simple runs ExecStart in the background with
                Restart=always/on-failure emulated by a loop that runs the whole start again

The boot runs as one shell script through the node's sshd (the node's own root, namespaces and
cgroup, like any process of the node); its output is appended to the node's
/var/log/vpscluster-boot.log. Not emulated: other unit types, socket/path activation, sysctl.d.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from vpscluster.cluster.sandbox.system import run_tool
from vpscluster.errors import UserError

UNIT_DIRS = ("etc/systemd/system", "run/systemd/system", "lib/systemd/system", "usr/lib/systemd/system")
EARLY_TARGETS = ("sysinit.target", "basic.target")
BOOT_TIMEOUT_S = 120.0
LOG = "/var/log/vpscluster-boot.log"


def parse_unit(text: str, unit: dict | None = None) -> dict:
    """A unit file's keys per section (lists: a key may repeat; an empty value resets the list)."""
    unit = unit if unit is not None else {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        if section is None or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if value:
            section.setdefault(key, []).append(value)
        else:
            section[key] = []
    return unit


def _find(root: Path, name: str) -> Path | None:
    for d in UNIT_DIRS:
        p = root / d / name
        if p.is_file():
            return p
    return None


def load_unit(root: Path, name: str) -> dict:
    """Unit `name` as the node sees it (a template instance `x@i.service` from `x@.service`,
    with %i/%I/%n), its drop-ins (`<name>.d/*.conf`) applied."""
    template = name
    instance = ""
    if "@" in name:
        prefix, _, rest = name.partition("@")
        instance, _, suffix = rest.rpartition(".")
        template = f"{prefix}@.{suffix}"
    path = _find(root, name) or _find(root, template)
    if path is None:
        raise UserError(f"unit {name} is enabled but no unit file exists for it")
    texts = [path.read_text()]
    for d in UNIT_DIRS:
        for dropin_dir in {root / d / f"{name}.d", root / d / f"{template}.d"}:
            if dropin_dir.is_dir():
                texts += [p.read_text() for p in sorted(dropin_dir.glob("*.conf"))]
    unit: dict = {}
    for text in texts:
        text = text.replace("%%", "\0").replace("%i", instance).replace("%I", instance).replace("%n", name)
        parse_unit(text.replace("\0", "%"), unit)
    return unit


def enabled_units(upper: Path, root: Path) -> list[str]:
    """Service units the node enabled on its own disk (`upper`), in boot order."""
    wants = sorted((upper / "etc/systemd/system").glob("*.wants/*.service"))
    early = {p.name for p in wants if p.parent.name[:-len(".wants")] in EARLY_TARGETS}
    names = sorted({p.name for p in wants}, key=lambda n: (n not in early, n))
    after = {n: {a for v in load_unit(root, n).get("Unit", {}).get("After", []) for a in v.split()} for n in names}
    ordered: list[str] = []
    while names:  # After= among them first (a cycle falls back to the name order)
        ready = [n for n in names if not (after[n] & set(names) - {n})] or names[:1]
        ordered.append(ready[0])
        names.remove(ready[0])
    return ordered


def _command(line: str) -> tuple[str, bool]:
    """An Exec line as shell text; whether a failure is ignored (leading `-`)."""
    ignore = False
    while line and line[0] in "-@+!:":
        ignore = ignore or line[0] == "-"
        line = line[1:]
    return shlex.join(shlex.split(line)), ignore


def unit_script(name: str, unit: dict) -> str:
    """Shell text that starts one unit as systemd would (see the module's docstring)."""
    svc = unit.get("Service", {})
    kind = (svc.get("Type") or ["simple"])[-1]
    env = [f"export {shlex.quote(pair)}" for v in svc.get("Environment", []) for pair in shlex.split(v) if "=" in pair]

    def steps(key: str) -> list[str]:
        out = []
        for line in svc.get(key, []):
            cmd, ignore = _command(line)
            out.append(cmd if ignore else f"{cmd} || exit 1")
        return out

    pre, start, post = steps("ExecStartPre"), svc.get("ExecStart", []), steps("ExecStartPost")
    q = shlex.quote(name)
    if kind in ("oneshot", "forking") or not start:
        body = "; ".join(env + pre + steps("ExecStart") + post + ["true"])
        return f"if ( {body} ) >>{LOG} 2>&1; then echo {q} started; else echo {q} failed; fi"
    main, _ = _command(start[-1])
    restart = (svc.get("Restart") or ["no"])[-1]
    delay = (svc.get("RestartSec") or ["0.1"])[-1].rstrip("s") or "0.1"
    once = "; ".join(pre + [f"{main} & p=$!"] + [s.replace("|| exit 1", "|| kill $p") for s in post] + ["wait $p"])
    loop = once if restart == "no" else \
        f"while :; do ( {once} ); rc=$?; [ {shlex.quote(restart)} = on-failure ] && [ $rc = 0 ] && break; sleep {delay}; done"
    script = "; ".join(env + [loop])
    return (f"setsid sh -c {shlex.quote(script)} </dev/null >>{LOG} 2>&1 & echo {q} started")


def boot_script(root: Path, upper: Path) -> tuple[list[str], str]:
    """(the units, in order; the script that shuts the node's leftovers down and starts them)."""
    names = enabled_units(upper, root)
    lines = ["find /run -mindepth 1 -maxdepth 1 ! -name sshd -exec rm -rf {} + 2>/dev/null",
             f"echo \"--- boot $(date -u +%FT%TZ)\" >>{LOG}"]
    lines += [unit_script(n, load_unit(root, n)) for n in names]
    return names, "\n".join(lines) + "\n"


def reboot(info, n, kill) -> dict:
    """Shut node `n` down (`kill(info, n)` ends its processes) and boot it from its own root."""
    from vpscluster.cluster.sandbox.checks import ssh_command

    if not info.own_root:
        raise UserError(f"sandbox {info.name}: reboot needs nodes with their own root (what a boot starts is "
                        f"read from the node's /etc); recreate it with `vpscluster sandbox up --own-root`")
    node_dir = Path(info.state_dir) / "nodes" / n.name
    try:
        sshd_pid = int((node_dir / "sshd.pid").read_text().strip())
    except (OSError, ValueError):
        raise UserError(f"sandbox {info.name}: {n.name} has no running sshd; bring the sandbox up again") from None
    record = kill(info, n)
    links = run_tool(["ip", "-n", n.namespace, "-o", "link", "show"], check=False).stdout.splitlines()
    removed = [ln.split(":")[1].strip().split("@")[0] for ln in links if ln.count(":") >= 2]
    removed = [x for x in removed if x not in ("lo", "eth0")]
    for link in removed:
        run_tool(["ip", "-n", n.namespace, "link", "delete", link], check=False)
    run_tool(["ip", "netns", "exec", n.namespace, "nft", "flush", "ruleset"], check=False)
    root = Path(f"/proc/{sshd_pid}/root")  # the node's own `/` (its sshd is chrooted into it)
    units, script = boot_script(root, node_dir / "rootfs" / "upper")
    try:
        r = subprocess.run(ssh_command(info, n, script), capture_output=True, text=True, timeout=BOOT_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"sandbox {info.name}: {n.name}'s boot did not finish within {BOOT_TIMEOUT_S:.0f} s") from None
    said = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line.endswith((" started", " failed")))
    if r.returncode != 0 and not said:
        raise UserError(f"sandbox {info.name}: {n.name}'s boot failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return {**record, "removed_links": removed, "units": {u: said.get(u, "not started") for u in units}}

