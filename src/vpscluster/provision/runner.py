"""Run `ansible-playbook` (ansible-core) with a timeout and turn its results into a report.

The playbook's own stdout callback (playbook/callback_plugins/vpscluster_json.py) writes every
task result as JSON to a file; `summarize` folds it into changed/ok/failed per node and role.
Ansible's state (SSH control sockets, temp files) lives in a private temp directory removed
afterwards, so nothing is left in ~/.ansible and no user ansible.cfg changes the behaviour.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from vpscluster.errors import RemoteError, UserError

ANSIBLE_HINT = "install ansible-core into vpscluster's environment: pip install 'ansible-core>=2.18,<2.19'"


def ansible_playbook() -> str:
    here = Path(sys.executable).parent / "ansible-playbook"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("ansible-playbook")
    if not found:
        raise UserError(f"provision: ansible-playbook not found; {ANSIBLE_HINT}")
    return found


def run_playbook(playbook: Path, inventory: dict, tags: Sequence[str], check: bool, timeout_s: float,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Run the playbook; return the callback's document {"results": [...], "stats": {...}}."""
    exe = ansible_playbook()
    with tempfile.TemporaryDirectory(prefix="vpsc-ans-") as tmp:
        t = Path(tmp)
        from vpscluster.provision.inventory import inventory_yaml

        inv = t / "inventory.yml"  # values tagged !unsafe: cluster-file text is never templated
        inv.write_text(inventory_yaml(inventory))
        result_file = t / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update({
            "ANSIBLE_CONFIG": str(t / "none.cfg"),  # no user/system ansible.cfg changes behaviour
            "ANSIBLE_HOME": str(t / "home"),
            "ANSIBLE_LOCAL_TEMP": str(t / "tmp"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(t / "cp"),
            "ANSIBLE_STDOUT_CALLBACK": "vpscluster_json",
            "ANSIBLE_CALLBACK_PLUGINS": str(playbook.parent / "callback_plugins"),
            "ANSIBLE_LIBRARY": str(playbook.parent / "library"),
            "ANSIBLE_ROLES_PATH": str(playbook.parent / "roles"),
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORKS": "20",
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_TIMEOUT": "30",
            "ANSIBLE_DEPRECATION_WARNINGS": "False",
            "VPSCLUSTER_PROVISION_RESULT": str(result_file),
        })
        argv = [exe, "-i", str(inv), str(playbook), "--tags", ",".join(tags)]
        if check:
            argv += ["--check", "--diff"]
        log: list[str] = []
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.append(line.rstrip("\n"))
                if progress and line.strip():
                    progress(line.strip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RemoteError(f"provision: ansible-playbook did not finish within {timeout_s:.0f} s; "
                              "raise --timeout or check the nodes (vpscluster exec --cluster ... -- true)") from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        reader.join(timeout=5)
        try:
            doc = json.loads(result_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            said = [line for line in log if line.strip()]
            raise RemoteError(f"provision: ansible-playbook failed (exit {proc.returncode}) before any result: "
                              f"{said[-1] if said else 'no output'}") from None
        doc["returncode"] = proc.returncode
        doc["log_tail"] = log[-40:]
        return doc


def summarize(doc: dict, nodes: Sequence[str], roles: Sequence[str], check: bool) -> dict:
    """Per node and role: counts of ok/changed/failed/skipped; what changed; what failed."""
    per: dict[str, dict] = {n: {"name": n, "roles": {r: Counter() for r in roles}, "changes": [],
                                "not_settable": {}, "notes": [], "errors": [], "unreachable": 0} for n in nodes}
    for r in doc.get("results", []):
        node = per.setdefault(r["host"], {"name": r["host"], "roles": {}, "changes": [], "not_settable": {},
                                          "notes": [], "errors": [], "unreachable": 0})
        role = r.get("role") or "-"
        status = r["status"]
        node["roles"].setdefault(role, Counter())[status] += 1
        if status == "changed":
            detail = r.get("changes") or ([r["dest"]] if r.get("dest") else [d["path"] for d in r.get("diff", []) if d.get("path")])
            node["changes"].append(f"{role}: {r['task']}" + (f" ({'; '.join(detail)})" if detail else ""))
        elif status in ("failed", "unreachable"):
            why = (r.get("msg") or r.get("stderr") or "").strip().splitlines()
            node["errors"].append(f"{role}: {r['task']}: {why[-1] if why else status}")
            if status == "unreachable":
                node["unreachable"] += 1
        node["not_settable"].update(r.get("not_settable") or {})
        node["notes"].extend(r.get("notes") or [])
    out_nodes = []
    for n in per.values():
        counts = Counter()
        for c in n["roles"].values():
            counts.update(c)
        status = ("unreachable" if n["unreachable"] else "failed" if counts["failed"]
                  else "changed" if counts["changed"] else "ok")
        out_nodes.append({
            "name": n["name"], "status": status, "ok": counts["ok"], "changed": counts["changed"],
            "failed": counts["failed"], "skipped": counts["skipped"], "unreachable": n["unreachable"],
            "roles": {r: {k: c[k] for k in ("ok", "changed", "failed", "skipped")} for r, c in n["roles"].items()},
            "changes": n["changes"], "not_settable": n["not_settable"], "notes": n["notes"], "errors": n["errors"],
        })
    changed = sum(n["changed"] for n in out_nodes)
    failed = sum(n["failed"] + n["unreachable"] for n in out_nodes)
    missing = [n["name"] for n in out_nodes if not any(sum(c.values()) for c in n["roles"].values())]
    if failed or missing:
        bad = [n["name"] for n in out_nodes if n["status"] in ("failed", "unreachable")] + missing
        summary = f"failed on {', '.join(dict.fromkeys(bad))}"
    elif changed:
        touched = sum(1 for n in out_nodes if n["changed"])
        summary = (f"{'would change' if check else 'changed'} {changed} setting{'s' if changed != 1 else ''} "
                   f"on {touched} node{'s' if touched != 1 else ''}")
    else:
        summary = "no changes" + (" would be made" if check else "")
    return {"check": check, "roles": list(roles), "ok": not (failed or missing), "changed": changed, "failed": failed,
            "summary": summary, "nodes": out_nodes, "returncode": doc.get("returncode"),
            "log_tail": doc.get("log_tail", []) if (failed or missing) else []}
