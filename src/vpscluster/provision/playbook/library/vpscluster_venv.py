#!/usr/bin/python
"""Ansible module: a venv holding exactly the pinned packages, installed from a local wheelhouse.

    vpscluster_venv:
      venv: /srv/vpscluster/venv
      python: python3                 # the node's interpreter the venv is made from
      python_version: "3.11"          # must match the controller's (same wheels, same bytecode)
      wheelhouse: /srv/vpscluster/wheelhouse
      requirements: {torch: 2.4.1, numpy: 2.1.0, ...}
      env_hash: 5e81ace92442f7a2

Compares what the venv really holds (importlib.metadata inside the venv, so a package changed
by hand is seen) with `requirements` and returns the differences as `differ` ({name: version};
the role runs it in check mode first, to push only those wheels). Installs the differences with
`pip --no-index --no-deps` (nodes need no internet) and `--no-compile`: byte-compiling every
module at install (torch ships thousands that training never imports) triples the install
time, and Python compiles what is imported on first use, into the venv the same user owns.
Writes `<venv>/vpscluster-env.json` (hash and packages). Check mode
reports the differences and changes nothing. Packages in the venv beyond the list are left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

from ansible.module_utils.basic import AnsibleModule

LIST = ("import json, importlib.metadata as m; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(module, argv, timeout=900):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        module.fail_json(msg=f"`{' '.join(argv[:4])}` did not finish within {timeout} s")
    except FileNotFoundError:
        module.fail_json(msg=f"{argv[0]} not found on this node")
    return p


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "venv": {"type": "path", "required": True},
            "python": {"type": "str", "default": "python3"},
            "python_version": {"type": "str", "required": True},
            "wheelhouse": {"type": "path", "required": True},
            "requirements": {"type": "dict", "required": True},
            "env_hash": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    venv_python = os.path.join(p["venv"], "bin", "python")
    wanted = {canonical(k): str(v) for k, v in p["requirements"].items()}
    changes: list[str] = []

    probe = run(module, [p["python"], "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=60)
    have_py = probe.stdout.strip()
    if probe.returncode != 0 or have_py != p["python_version"]:
        module.fail_json(msg=f"this node's {p['python']} is Python {have_py or '?'}, the controller's is "
                             f"{p['python_version']}; install Python {p['python_version']} on the node (or set "
                             "env_python to one) so both run the same wheels")

    exists = os.access(venv_python, os.X_OK)
    installed: dict[str, str] = {}
    if exists:
        listing = run(module, [venv_python, "-c", LIST], timeout=120)
        if listing.returncode == 0:
            installed = {canonical(k): v for k, v in json.loads(listing.stdout).items()}
        else:
            exists = False  # a broken venv is made anew
    if not exists:
        changes.append(f"{p['venv']}: created")
    differ = {n: v for n, v in wanted.items() if installed.get(n) != v}
    for n, v in sorted(differ.items()):
        changes.append(f"{n} {installed[n]} -> {v}" if n in installed else f"{n} {v} installed")
    marker = os.path.join(p["venv"], "vpscluster-env.json")
    doc = {"env_hash": p["env_hash"], "python": p["python_version"], "packages": dict(sorted(wanted.items()))}
    try:
        with open(marker) as f:
            marker_ok = json.load(f) == doc
    except (OSError, ValueError):
        marker_ok = False
    if not marker_ok and not differ and exists:
        changes.append(f"{marker}: rewritten")

    if changes and not module.check_mode:
        if not exists:
            made = run(module, [p["python"], "-m", "venv", "--clear", p["venv"]], timeout=300)
            if made.returncode != 0:
                module.fail_json(msg=f"python -m venv {p['venv']} failed: {(made.stderr or made.stdout).strip()[-500:]}")
        if differ:
            wheels = os.listdir(p["wheelhouse"]) if os.path.isdir(p["wheelhouse"]) else []
            if not wheels:
                module.fail_json(msg=f"no wheels in {p['wheelhouse']}")
            specs = [f"{n}=={v}" for n, v in sorted(differ.items())]
            inst = run(module, [venv_python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                                "--no-deps", "--no-compile", "--force-reinstall", "--find-links", p["wheelhouse"], *specs])
            if inst.returncode != 0:
                said = (inst.stderr or inst.stdout).strip().splitlines()
                module.fail_json(msg=f"pip install from the wheelhouse failed: {said[-1] if said else inst.returncode}",
                                 changes=changes)
        with open(marker + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(marker + ".tmp", marker)

    module.exit_json(changed=bool(changes), changes=changes, differ=differ, env_hash=p["env_hash"], venv=p["venv"],
                     values={"python": os.path.join(p["venv"], "bin", "python"), "env_hash": p["env_hash"]})


if __name__ == "__main__":
    main()
