"""Ansible stdout callback: one JSON document with every task result, for `vpscluster provision`.

Writes to the file named by $VPSCLUSTER_PROVISION_RESULT (stdout keeps one short line per task,
for the log). Each result: host, role, task, status (ok|changed|failed|unreachable|skipped),
the module's message and, where the module returns them, `changes` / `not_settable` / `notes`.
Use it outside vpscluster with ANSIBLE_STDOUT_CALLBACK=vpscluster_json.
"""

from __future__ import annotations

import json
import os

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: vpscluster_json
type: stdout
short_description: vpscluster provision's machine-readable results
description: every task result as JSON in $VPSCLUSTER_PROVISION_RESULT
"""

KEEP = ("msg", "changes", "not_settable", "notes", "rc", "stderr", "values", "dest")


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "vpscluster_json"

    def __init__(self) -> None:
        super().__init__()
        self.results: list[dict] = []
        self.stats: dict = {}

    def _record(self, result, status: str) -> None:
        task = result._task
        role = task._role.get_name() if task._role else None
        res = result._result or {}
        entry = {"host": result._host.get_name(), "role": role, "task": task.get_name().split(" : ", 1)[-1], "status": status}
        for key in KEEP:
            if key in res and res[key] not in (None, "", [], {}):
                value = res[key]
                entry[key] = value[-2000:] if isinstance(value, str) else value
        if res.get("diff") and status == "changed":
            diffs = res["diff"] if isinstance(res["diff"], list) else [res["diff"]]
            entry["diff"] = [{"path": d.get("before_header") or d.get("after_header"),
                              "before": str(d.get("before", ""))[-4000:], "after": str(d.get("after", ""))[-4000:]}
                             for d in diffs if isinstance(d, dict)]
        self.results.append(entry)
        self._display.display(f"{entry['host']}: {role or '-'}: {entry['task']}: {status}")

    def v2_runner_on_ok(self, result) -> None:
        self._record(result, "changed" if result._result.get("changed") else "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False) -> None:
        self._record(result, "ok" if ignore_errors else "failed")

    def v2_runner_on_unreachable(self, result) -> None:
        self._record(result, "unreachable")

    def v2_runner_on_skipped(self, result) -> None:
        self._record(result, "skipped")

    def v2_playbook_on_stats(self, stats) -> None:
        hosts = sorted(stats.processed.keys())
        self.stats = {h: stats.summarize(h) for h in hosts}
        path = os.environ.get("VPSCLUSTER_PROVISION_RESULT")
        doc = {"results": self.results, "stats": self.stats}
        if path:
            with open(path, "w") as f:
                json.dump(doc, f)
        else:
            self._display.display(json.dumps(doc))
