#!/usr/bin/python
"""Ansible module: set net.* sysctls now and persist them in one /etc/sysctl.d file.

Shipped with vpscluster's playbook (ansible-core has no sysctl module; ansible.posix's needs a
collection the nodes may not be able to download). Check mode and --diff are supported.

    vpscluster_sysctl:
      file: /etc/sysctl.d/60-vpscluster-tcp.conf
      at_least: {net.core.rmem_max: 16777216, net.ipv4.tcp_rmem: "4096 131072 16777216"}
      exact: {net.ipv4.tcp_mtu_probing: "1"}
      congestion_control: [bbr, cubic]

`at_least` raises every number of a value to at least the one given (never lowers a setting
that already allows more); `exact` sets the value as given. `congestion_control` picks the
first algorithm in /proc/sys/net/ipv4/tcp_available_congestion_control.

Only `net.*` keys are accepted. A key whose /proc/sys file does not exist here (a host-wide
setting seen from inside a network namespace: a container, a vpscluster sandbox node) or
cannot be written is reported under `not_settable` with the reason, never forced; the file
then records only what applies here. Returns `values` (key -> value now) and `set` (changed).
"""

from __future__ import annotations

import os

from ansible.module_utils.basic import AnsibleModule

HEADER = "# Written by vpscluster provision (role tcp). Changes here are overwritten by the next run.\n"


def proc_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def read(key: str) -> str | None:
    try:
        with open(proc_path(key)) as f:
            return " ".join(f.read().split())
    except OSError:
        return None


def raised(current: str, wanted: str) -> str:
    cur, want = current.split(), str(wanted).split()
    if len(cur) != len(want) or not all(x.lstrip("-").isdigit() for x in cur + want):
        return " ".join(want)
    return " ".join(str(max(int(c), int(w))) for c, w in zip(cur, want))


def in_init_netns() -> bool | None:
    """False inside a child network namespace (a container, a sandbox node); None: unknown."""
    try:
        return os.stat("/proc/self/ns/net").st_ino == os.stat("/proc/1/ns/net").st_ino
    except OSError:
        pass
    # /proc/1 may be out of reach; host-wide net.core settings are listed only in the first namespace.
    if os.path.isdir("/proc/sys/net/core"):
        return os.path.exists("/proc/sys/net/core/netdev_max_backlog")
    return None


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "file": {"type": "path", "required": True},
            "at_least": {"type": "dict", "default": {}},
            "exact": {"type": "dict", "default": {}},
            "congestion_control": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    wanted: dict[str, tuple[str, bool]] = {}
    for key, value in p["at_least"].items():
        wanted[key] = (str(value), True)
    for key, value in p["exact"].items():
        wanted[key] = (str(value), False)
    not_settable: dict[str, str] = {}
    notes: list[str] = []
    if p["congestion_control"]:
        available = (read("net.ipv4.tcp_available_congestion_control") or "").split()
        choice = next((c for c in p["congestion_control"] if c in available), None)
        if choice:
            wanted["net.ipv4.tcp_congestion_control"] = (choice, False)
            if choice != p["congestion_control"][0]:
                notes.append(f"{p['congestion_control'][0]} is not offered by this kernel (available: "
                             f"{' '.join(available)}); using {choice}")
        else:
            not_settable["net.ipv4.tcp_congestion_control"] = (
                f"none of {', '.join(p['congestion_control'])} offered (available: {' '.join(available) or '?'})")
    bad = [k for k in wanted if not k.startswith("net.") or "/" in k or ".." in k]
    if bad:
        module.fail_json(msg=f"only net.* sysctls are managed here, not {', '.join(bad)}")

    netns_note = "" if in_init_netns() is not False else " inside this network namespace"
    before: dict[str, str] = {}
    target: dict[str, str] = {}
    for key, (value, at_least) in wanted.items():
        current = read(key)
        if current is None:
            not_settable[key] = (f"not available{netns_note} (a host-wide setting; set it on the host)"
                                 if netns_note else "not available in this kernel")
            continue
        before[key] = current
        target[key] = raised(current, value) if at_least else " ".join(value.split())

    changed_keys = [k for k in target if target[k] != before[k]]
    if not module.check_mode:
        for key in changed_keys:
            try:
                with open(proc_path(key), "w") as f:
                    f.write(target[key] + "\n")
            except OSError as e:
                not_settable[key] = f"cannot be written here ({e.strerror}){netns_note}"
        for key in list(changed_keys):
            if key in not_settable:
                changed_keys.remove(key)
                target.pop(key)
            elif read(key) != target[key]:
                not_settable[key] = f"the kernel kept {read(key)!r} instead of {target[key]!r}"
                changed_keys.remove(key)
                target.pop(key)

    content = HEADER + "".join(f"{k} = {target[k]}\n" for k in sorted(target))
    try:
        with open(p["file"]) as f:
            on_disk = f.read()
    except OSError:
        on_disk = None
    file_changed = on_disk != content
    if file_changed and not module.check_mode:
        os.makedirs(os.path.dirname(p["file"]), exist_ok=True)
        tmp = p["file"] + ".vpscluster-tmp"
        with open(tmp, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p["file"])

    changes = [f"{k}: {before[k]} -> {target[k]}" for k in changed_keys]
    if file_changed:
        changes.append(f"{p['file']}: {'rewritten' if on_disk is not None else 'created'}")
    module.exit_json(
        changed=bool(changes), changes=changes, values={k: read(k) for k in target} if not module.check_mode else target,
        before=before, not_settable=not_settable, notes=notes,
        diff={"before": on_disk or "", "after": content, "before_header": p["file"], "after_header": p["file"]},
    )


if __name__ == "__main__":
    main()
