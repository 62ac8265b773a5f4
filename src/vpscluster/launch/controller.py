"""The controller on the cluster: `train|run --detach --controller NODE` runs the launcher on a node.

The laptop can then sleep, lose its network or be SIGKILLed: the launcher (and so the node-side
guards' SSH sessions) lives on NODE (`head`: the cluster's head). What is shipped there:

    <workdir>/code/src/vpscluster            the package, synced by content hash (as for the workers)
    <workdir>/controller/<run>/cluster.yaml  the cluster file as NODE sees it: every node reached
                                             with the controller key, checked against known_hosts
    <workdir>/controller/<run>/known_hosts   the host keys the user already accepted, for these nodes only
    <workdir>/controller/<run>/id_ed25519    the cluster's controller key (never the user's own key)
    <workdir>/controller/<run>/data/NAME     the training data, where it is a local file or folder
    <workdir>/controller/<run>/code/NAME     `run`: the user's folder (`--sync DIR` or the current one),
                                             synced as `run` syncs it to the nodes
    <workdir>/controller-runs/<run>/         the run dir there: config.yaml (resolved here), then
                                             everything the launcher writes

The controller key pair is made once per cluster file and kept beside it
(`.vpscluster/<stem>.controller_ed25519`, like the cluster's other records); its public key is
added to every node's authorized_keys over the user's own SSH (`$VPSC_AUTHORIZED_KEYS` where the
node's sshd names another file, as the sandbox's does). On NODE, the run is started as a
detached `train --resume` of that run dir (launch/detached.py: a session of its own, no
terminal), so the SSH session that started it may go; a `run` as a detached `vpscluster run` of
the shipped folder, with the user's options (cli/detach.py `run_argv_for_controller`).

Here, the run dir holds config.yaml and launcher.json with "controller", "remote_run_dir" and how
to run vpscluster on NODE; `attach`, `logs`, `stop` and `report` run the same command on NODE over
the user's SSH (`remote_cli`), `report` then fetches report.json, metrics.jsonl and report.html.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import posixpath
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from vpscluster import fsutil
from vpscluster.errors import RemoteError, UserError

KEY_KIND = "controller_ed25519"
CONNECT_TIMEOUT_S = 60.0
SYNC_TIMEOUT_S = 600.0
START_TIMEOUT_S = 300.0  # `train --resume --detach` on NODE: resolving the run, then starting the launcher
FETCHED = ("report.json", "metrics.jsonl", "report.html")


def is_remote(state: dict[str, Any] | None) -> bool:
    """launcher.json of a run whose launcher runs on a node of the cluster."""
    return bool(state and state.get("controller"))


def resolve_node(cluster, name: str):
    """The node `name` names (`head`: the cluster's head); a one-line error otherwise."""
    if cluster.is_local:
        raise UserError("--controller needs a cluster file (--cluster FILE): the local cluster has no node to run it on")
    if name == "head":
        return cluster.head_node
    try:
        return cluster.node(name)
    except KeyError:
        names = ", ".join(n.name for n in cluster.nodes)
        raise UserError(f"--controller {name}: no node {name} in {cluster.source} (its nodes: {names}; "
                        "or `head` for its head)") from None


def key_path(cluster) -> Path:
    """Where the cluster's controller key is (made once), beside the cluster file's other records."""
    from vpscluster.cluster import records

    for json_path in records.candidates(cluster, KEY_KIND):
        key = json_path.with_suffix("")  # <folder>/<stem>.controller_ed25519
        if key.is_file() or _writable(key.parent):
            return key
    raise UserError(f"cannot keep the controller key beside {cluster.source}: no writable folder; "
                    "make the cluster file's folder writable")


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def ensure_key(cluster) -> tuple[Path, str]:
    """The controller key pair (private key path, public key line), generated the first time."""
    key = key_path(cluster)
    pub = key.with_name(key.name + ".pub")
    if not (key.is_file() and pub.is_file()):
        for p in (key, pub):
            p.unlink(missing_ok=True)
        try:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"vpscluster-controller@{Path(cluster.source).stem}",
                            "-f", str(key)], check=True, capture_output=True, timeout=30)
        except FileNotFoundError:
            raise UserError("ssh-keygen not found: install OpenSSH's client tools to make the controller key") from None
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise UserError(f"ssh-keygen could not make the controller key {key}: {getattr(e, 'stderr', b'') or e}") from None
    return key, pub.read_text().strip()


def known_hosts_text(cluster) -> str:
    """The lines of the user's known_hosts for the cluster's nodes (hashed entries included)."""
    from vpscluster.cluster.known_hosts import host_pattern

    source = Path(cluster.known_hosts or "~/.ssh/known_hosts").expanduser()
    lines: list[str] = []
    for node in cluster.nodes:
        try:
            r = subprocess.run(["ssh-keygen", "-F", host_pattern(node.host, node.port), "-f", str(source)],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UserError(f"cannot read the host keys of {node.name} from {source} ({e}); check that file") from None
        found = [ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
        if not found:
            raise UserError(f"{source} holds no host key for {node.name} ({node.host}); connect once from here "
                            "(e.g. `vpscluster probe --accept-new-host-keys`) before detaching to a controller")
        lines += [ln for ln in found if ln not in lines]
    return "\n".join(lines) + "\n"


def node_cluster_doc(cluster, support: str, without: list[str] = ()) -> dict[str, Any]:
    """The cluster file as the controller node uses it: the user's own file, with every node
    reached with the controller key and checked against the shipped known_hosts, and `python` as
    resolved here (a provisioned venv's record stays here). `queue:` is left out: its secret
    files stay on this machine (training does not use the queue). The nodes `without` are left
    out (the head moves to the first node left when it is one of them)."""
    from vpscluster.config import load_yaml

    doc = dict(load_yaml(cluster.source, what="cluster file"))
    key = posixpath.join(support, "id_ed25519")
    doc.pop("queue", None)
    doc.update(known_hosts=posixpath.join(support, "known_hosts"), accept_new_host_keys=False,
               insecure_network=bool(cluster.insecure_network), head=cluster.head)
    doc["defaults"] = {**(doc.get("defaults") or {}), "identity_file": key}
    python = {n.name: n.python for n in cluster.nodes}
    doc["nodes"] = [{**entry, "identity_file": key, "python": python[entry["name"]]} for entry in doc["nodes"]
                    if entry["name"] not in without]
    if doc["head"] in without:
        doc["head"] = doc["nodes"][0]["name"]
    return doc


def _authorize_command(pub: str) -> str:
    q = shlex.quote(pub)
    return ('f="${VPSC_AUTHORIZED_KEYS:-$HOME/.ssh/authorized_keys}"; mkdir -p "$(dirname "$f")" && '
            f'touch "$f" && chmod 600 "$f" && (grep -qxF {q} "$f" || echo {q} >> "$f")')


def _unreachable(node, why: str) -> UserError:
    return UserError(f"controller node {node.name} ({node.host}) unreachable: {why.rstrip(' .;')} "
                     "(fix it, or pick another node with --controller NODE)")


class TrainShipment:
    """`train --detach --controller`: the resolved run (config.yaml, the data), started on NODE
    as `train --resume` of its run dir there.

    A new run whose split is still open is balanced here first, from the probe pre-flight would
    take (`decide_balance`): NODE starts it as a resume, which keeps the stored split. A resumed
    run leaves out the nodes that do not answer now (the controller's own node must), and takes
    the run's metrics so far (the local metrics.jsonl) along, so its history stays whole."""

    command = "train"

    def __init__(self, prepared):
        self.prepared = prepared
        self.resume = bool(prepared.resume)
        self.run_dir = Path(prepared.run_dir)

    async def before(self, executors, say: Callable[[str], None]) -> None:
        if not self.resume:
            await decide_balance(self.prepared, executors, say)
        else:
            await gather_history(self.prepared, executors)

    async def ship(self, ex, support: str, remote_run: str, tmp: Path, say: Callable[[str], None]) -> list[str]:
        from vpscluster.launch.sync import sync_dir
        from vpscluster.train import rundir

        prepared = self.prepared
        cfg = copy.deepcopy(prepared.cfg)
        cfg.cluster = posixpath.join(support, "cluster.yaml")
        cfg.run_dir = remote_run
        if cfg.data:
            data = os.path.abspath(cfg.data)
            target = posixpath.join(support, "data", os.path.basename(data))
            if os.path.isdir(data):
                await sync_dir(ex, data, target, timeout_s=SYNC_TIMEOUT_S, detect_shared=False, say=say)
            else:
                await ex.put(data, target, timeout_s=SYNC_TIMEOUT_S)
            cfg.data = target
        rundir.write_config(cfg, tmp)
        await ex.put(str(tmp / rundir.CONFIG), posixpath.join(remote_run, rundir.CONFIG), timeout_s=CONNECT_TIMEOUT_S)
        return (["train", "--resume", remote_run, "--detach", "--json"] + (["--force"] if prepared.force else [])
                + (["--insecure-network"] if prepared.cluster.insecure_network else []))


class RunShipment:
    """`run --detach --controller`: the user's folder (what `run` syncs to the nodes: `--sync DIR`
    or the current folder, less caches and likely secrets, launch/sync.py) goes to
    `<support>/code/<its name>` on NODE, which starts `vpscluster run` there with the same
    arguments, rewritten to the shipped paths: `argv(cluster_file, shipped_folder, remote_run)`
    (cli/detach.py `run_argv_for_controller`)."""

    command = "run"

    def __init__(self, run_dir: Path, root: str, argv: Callable[[str, str, str], list[str]], resume: bool = False):
        self.run_dir = Path(run_dir)
        self.root = os.path.abspath(root)
        self.argv = argv
        self.resume = resume  # `run --resume`: the run's metrics so far go along (launch/run.py merges them)

    async def before(self, executors, say: Callable[[str], None]) -> None:
        return None  # NODE's pre-flight balances the run, from the probe shipped along when it is fresh

    async def ship(self, ex, support: str, remote_run: str, tmp: Path, say: Callable[[str], None]) -> list[str]:
        from vpscluster.launch.sync import sync_dir

        target = posixpath.join(support, "code", os.path.basename(self.root.rstrip("/")) or "root")
        await sync_dir(ex, self.root, target, timeout_s=SYNC_TIMEOUT_S, detect_shared=False, say=say)
        return self.argv(posixpath.join(support, "cluster.yaml"), target, remote_run)


async def _ship(cluster, node, shipment, say: Callable[[str], None]) -> dict[str, Any]:
    """Everything the launcher needs on `node` (the package, the cluster file as NODE sees it,
    the controller key, known_hosts, a fresh probe, and what `shipment` adds: TrainShipment,
    RunShipment), then the launcher itself; its launcher.json there."""
    from vpscluster.cluster.inventory import open_executors
    from vpscluster.launch.preflight import resolve_workdirs
    from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir, sync_dir
    from vpscluster.train import rundir

    async with open_executors(cluster) as executors:
        ex = next(e for e in executors if e.node.name == node.name)
        try:
            workdir = (await resolve_workdirs([ex], CONNECT_TIMEOUT_S))[node.name]
        except RemoteError as e:
            raise _unreachable(node, str(e).split(": ", 1)[-1].split(" — ")[0]) from None
        key, pub = ensure_key(cluster)
        hosts = known_hosts_text(cluster)
        say(f"controller {node.name}: adding the cluster's controller key to every node's authorized_keys")
        results = await asyncio.gather(*(e.run(_authorize_command(pub), timeout_s=CONNECT_TIMEOUT_S) for e in executors))
        silent = [r.node for r in results if (r.error or r.timed_out) and r.node != node.name] if shipment.resume else []
        if silent:  # a resume goes on without them, as a relaunch would (the run's --min-nodes holds)
            say(f"controller {node.name}: {', '.join(silent)} do{'es' if len(silent) == 1 else ''} not answer; "
                "the run goes on without them (a later --resume takes them back)")
            results = [r for r in results if r.node not in silent]
        bad = [f"{r.node}: {r.reason()}" for r in results if not r.ok]
        if bad:
            raise RemoteError("cannot add the controller key on " + "; ".join(bad) + " — fix the node or remove it from the cluster file")
        await shipment.before([e for e in executors if e.node.name not in silent], say)
        run_name = shipment.run_dir.name
        support = posixpath.join(workdir, "controller", run_name)
        remote_run = posixpath.join(workdir, "controller-runs", run_name)
        pkg = await sync_dir(ex, package_dir(), posixpath.join(workdir, PACKAGE_ON_NODE), timeout_s=SYNC_TIMEOUT_S, say=say)
        pythonpath = posixpath.dirname(pkg.remote_path.rstrip("/"))
        r = await ex.run(f"mkdir -p {shlex.quote(support)}/data {shlex.quote(support)}/.vpscluster"
                         f" {shlex.quote(remote_run)}/logs {shlex.quote(remote_run)}/checkpoints"
                         f" && chmod 700 {shlex.quote(support)}", timeout_s=CONNECT_TIMEOUT_S)
        if not r.ok:
            raise RemoteError(f"controller node {node.name}: cannot make {support}: {r.reason()}")
        with tempfile.TemporaryDirectory(prefix="vpsc-ctl-") as tmp:
            import yaml

            t = Path(tmp)
            argv = await shipment.ship(ex, support, remote_run, t, say)
            history = shipment.run_dir / rundir.METRICS
            if shipment.resume and history.is_file():  # a resumed run's metrics so far: its history stays whole
                await ex.put(str(history), posixpath.join(remote_run, rundir.METRICS), timeout_s=SYNC_TIMEOUT_S)
            (t / "known_hosts").write_text(hosts)
            (t / "cluster.yaml").write_text(yaml.safe_dump(node_cluster_doc(cluster, support, silent), sort_keys=False))
            shipped = [("id_ed25519", key), ("known_hosts", t / "known_hosts"), ("cluster.yaml", t / "cluster.yaml")]
            probe = _fresh_probe(cluster)
            if probe is not None:  # the probe just taken or saved here: NODE's pre-flight need not take another
                (t / "cluster.probe.json").write_text(json.dumps(probe))
                shipped.append((posixpath.join(".vpscluster", "cluster.probe.json"), t / "cluster.probe.json"))
            for name, src in shipped:
                await ex.put(str(src), posixpath.join(support, name), timeout_s=CONNECT_TIMEOUT_S)
        r = await ex.run(f"chmod 600 {shlex.quote(posixpath.join(support, 'id_ed25519'))}", timeout_s=CONNECT_TIMEOUT_S)
        if not r.ok:
            raise RemoteError(f"controller node {node.name}: cannot protect the controller key: {r.reason()}")
        where = {"controller": node.name, "remote_run_dir": remote_run, "remote_cwd": support,
                 "remote_python": node.python, "remote_pythonpath": pythonpath, "command": shipment.command}
        say(f"controller {node.name}: starting the launcher in {remote_run}")
        r = await ex.run(remote_command(where, argv), timeout_s=START_TIMEOUT_S)
        if not r.ok:
            raise RemoteError(f"controller node {node.name}: the launcher did not start: {r.reason()}")
        try:
            started = json.loads(r.stdout[r.stdout.index("{"):])
        except ValueError:
            raise RemoteError(f"controller node {node.name}: the launcher printed no JSON: {r.stdout[-300:]!r}") from None
        return {**where, "pid": started["pid"], "remote_log": started["log"], "host": node.host}


def _fresh_probe(cluster) -> dict | None:
    """The probe of `cluster` saved here and still fresh for a launch (what pre-flight would
    reuse), to go beside the cluster file shipped to the controller node: the probe covers the
    nodes (names, addresses, users, interpreters: `probe.store.fingerprint`), which the shipped
    file keeps, so NODE finds it there (or its part, for a resume without silent nodes) instead of
    spending a quick probe of its own on every start."""
    from vpscluster.launch.preflight import PROBE_MAX_AGE_S
    from vpscluster.probe.store import load_probe

    return load_probe(cluster, PROBE_MAX_AGE_S)


async def gather_history(prepared, executors) -> None:
    """The run's metrics so far, into the local metrics.jsonl: what is here, and each node's copy
    (rank 0 wrote its lines on whichever node it ran, launch by launch; the controller that died
    fetched none of them). A step's line is taken from the first copy that has it; the new
    launcher replaces those past the checkpoint it resumes from (train/metrics.py merge_launch)."""
    from vpscluster.launch.preflight import resolve_workdirs
    from vpscluster.train import rundir
    from vpscluster.train.metrics import read_metrics, write_metrics

    path = Path(prepared.run_dir) / rundir.METRICS
    lines = read_metrics(path)
    try:
        workdirs = await resolve_workdirs(executors, CONNECT_TIMEOUT_S)
    except RemoteError:
        return  # one stopped answering since: the history here is what there is
    name = rundir.node_name(prepared.run_dir, prepared.cfg.run_uid)

    def key(line: dict[str, Any]) -> tuple[int, bool]:
        return int(line.get("step", 0)), "val_loss" in line

    kept = {key(x): x for x in lines}
    with tempfile.TemporaryDirectory(prefix="vpsc-ctl-") as tmp:
        for ex in executors:
            remote = posixpath.join(workdirs[ex.node.name], "runs", name, rundir.METRICS)
            r = await ex.run(["test", "-f", remote], timeout_s=CONNECT_TIMEOUT_S)
            if not r.ok:
                continue
            local = Path(tmp) / ex.node.name
            try:
                await ex.get(remote, str(local), timeout_s=SYNC_TIMEOUT_S)
            except Exception:
                continue  # a copy we cannot read adds nothing; the others still count
            for x in read_metrics(local):
                kept.setdefault(key(x), x)
    if kept:
        write_metrics(path, [kept[k] for k in sorted(kept)])


async def decide_balance(prepared, executors, say: Callable[[str], None]) -> None:
    """Balancing by default (launch/balance.py) for a new run the saved probe left undecided:
    decided here from a fresh probe (a quick one when none is fresh, saved as pre-flight saves it),
    as pre-flight decides it on a run launched from here; `prepared.cfg` changes in place."""
    from vpscluster.launch.balance import apply_default_balance, undecided
    from vpscluster.launch.preflight import probe_facts
    from vpscluster.launch.train import _probe_gpus, check_speeds_count, ranks_per_node

    cfg, cluster = prepared.cfg, prepared.cluster
    if not undecided(cfg):
        return
    facts = await probe_facts(cluster, executors, prepared.force, say)
    probe = {"nodes": [{**f, "name": name} for name, f in facts.items()]}
    ranks = ranks_per_node(cfg, cluster, _probe_gpus(probe))
    line = apply_default_balance(cfg, probe, ranks)
    if line:
        cfg.validate()
        say(line)
    check_speeds_count(cfg, ranks)


def remote_command(where: dict[str, Any], argv: list[str]) -> str:
    """`vpscluster ARGV` as the controller node runs it: its synced package first on PYTHONPATH."""
    import shutil

    columns = shutil.get_terminal_size((120, 24)).columns  # its lines wrapped as this terminal's would be
    return (f"cd {shlex.quote(where['remote_cwd'])} && PYTHONPATH={shlex.quote(where['remote_pythonpath'])} "
            f"PYTHONUNBUFFERED=1 COLUMNS={columns} exec {shlex.quote(where['remote_python'])} -m vpscluster "
            + " ".join(shlex.quote(a) for a in argv))


def start(prepared, node_name: str, argv: list[str], say: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """Run `prepared`'s launcher on node `node_name` (`head` for the head); record it here.
    Returns the local launcher.json."""
    from vpscluster.train import rundir

    cluster = prepared.cluster
    node = resolve_node(cluster, node_name)
    run_dir = Path(prepared.run_dir)
    rundir.fresh_path(run_dir)  # refused before anything is shipped
    where = asyncio.run(_ship(cluster, node, TrainShipment(prepared), say))
    rundir.create(run_dir)
    rundir.write_config(prepared.cfg, run_dir)
    return _record(run_dir, cluster, where, argv)


def start_run(cluster, node_name: str, run_dir: Path, root: str, run_argv: Callable[[str, str, str], list[str]],
              argv: list[str], say: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """`run --detach --controller NODE`: the user's folder `root` to NODE and `vpscluster run
    RUN_ARGV(...)` started there (RunShipment); recorded in the local `run_dir` (logs/ and
    launcher.json: what `attach`, `logs`, `stop` and `report` read). Returns the local launcher.json."""
    from vpscluster.launch import detached
    from vpscluster.train import rundir

    node = resolve_node(cluster, node_name)
    run_dir = Path(run_dir)
    rundir.fresh_path(run_dir)  # refused before anything is shipped
    if (run_dir / detached.STATE).exists():
        raise UserError(f"--run-dir {run_dir} already holds a run; pick a new folder")
    where = asyncio.run(_ship(cluster, node, RunShipment(run_dir, root, run_argv), say))
    rundir.create(run_dir)
    return _record(run_dir, cluster, where, argv)


def _record(run_dir: Path, cluster, where: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    from vpscluster.launch import detached

    state = {**where, "cluster": str(Path(cluster.source).resolve()), "argv": argv, "started": time.time(),
             "run_dir": str(run_dir)}
    fsutil.write_json(run_dir / detached.STATE, state)
    return state


def resume(prepared, node_name: str, argv: list[str], say: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """Continue `prepared` (a resume) with its launcher on node `node_name`, from the newest
    checkpoint the nodes hold: after its controller node died or its launcher was stopped or
    killed (or for a run launched from here). Refused while its launcher still runs. The metrics
    the previous controller holds come here first (when it answers), then go along."""
    return _resume(prepared.cluster, Path(prepared.run_dir), node_name, TrainShipment(prepared), argv, say)


def resume_run(cluster, node_name: str, run_dir: Path, root: str, run_argv: Callable[[str, str, str], list[str]],
               argv: list[str], say: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """`run --resume RUN --detach --controller NODE`: as `resume`, for a run of the user's script:
    its folder shipped again, `vpscluster run --resume` on NODE (the script's `session.resume()`
    continues from the newest checkpoint the nodes hold), the run's metrics so far along."""
    return _resume(cluster, Path(run_dir), node_name, RunShipment(run_dir, root, run_argv, resume=True), argv, say)


def _resume(cluster, run_dir: Path, node_name: str, shipment, argv: list[str], say: Callable[[str], None]) -> dict[str, Any]:
    from vpscluster.launch import detached
    from vpscluster.train import rundir

    node = resolve_node(cluster, node_name)
    old = detached.read_state(run_dir) or {}
    previous = list(old.get("previous_controllers") or [])
    if is_remote(old):
        where = launcher_state(old)
        if where == "running":
            raise UserError(f"run {run_dir}: its launcher still runs on {old['controller']}; stop it first "
                            f"(vpscluster stop {run_dir}) or follow it (vpscluster attach {run_dir})")
        if where == "gone":
            try:
                fetch(run_dir, old, names=(rundir.METRICS,))
            except UserError:
                pass  # it answered a moment ago; the local copy is what we have
        else:
            say(f"controller {old['controller']} does not answer ({where}); continuing the run on {node.name} "
                "(should its launcher still run, the nodes refuse the second launch of the run)")
        previous.append({k: old.get(k) for k in ("controller", "remote_run_dir", "started")})
    where = asyncio.run(_ship(cluster, node, shipment, say))
    state = {**where, "cluster": str(Path(cluster.source).resolve()), "argv": argv, "started": time.time(),
             "run_dir": str(run_dir), "previous_controllers": previous}
    fsutil.write_json(run_dir / detached.STATE, state)
    return state


def continue_command(state: dict[str, Any], run_dir, node: str = "NODE") -> str:
    """How to continue a run whose launcher was on a controller node, on `node`: `train --resume`,
    or for a `run`, `run --resume` with its cluster file and command."""
    if state.get("command") != "run":
        return f"vpscluster train --resume {run_dir} --detach --controller {node}"
    argv = list(state.get("argv") or [])
    program = argv[argv.index("--") + 1:] if "--" in argv else ["COMMAND"]
    return (f"vpscluster run --resume {run_dir} --detach --controller {node} --cluster {state.get('cluster', 'FILE')} -- "
            + " ".join(shlex.quote(w) for w in program))


_LAUNCHER_CHECK = ("import sys; from vpscluster.launch import detached, runlock; d = sys.argv[1]; "
                   "s = detached.read_state(d) or {}; "
                   "print('running' if runlock.holder(d) or (s.get('exit_status') is None and detached.running(s)) else 'gone')")


def launcher_state(state: dict[str, Any], timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """Whether the run's launcher on its controller node runs: "running", "gone", or why the node
    could not tell (it does not answer)."""

    async def go() -> str:
        ex = _executor(state)
        try:
            cmd = (f"cd {shlex.quote(state['remote_cwd'])} && PYTHONPATH={shlex.quote(state['remote_pythonpath'])} "
                   f"exec {shlex.quote(state['remote_python'])} -c {shlex.quote(_LAUNCHER_CHECK)} "
                   f"{shlex.quote(state['remote_run_dir'])}")
            r = await ex.run(cmd, timeout_s=timeout_s)
        finally:
            await ex.close()
        if r.error or r.timed_out:
            return r.reason()
        answer = r.stdout.strip().splitlines()[-1:] if r.ok else []
        return answer[0] if answer and answer[0] in ("running", "gone") else f"cannot tell: {r.reason()}"

    return asyncio.run(go())


def no_answer(state: dict[str, Any], why: str) -> UserError:
    """The one line for a controller node that does not answer: the run goes on there if the node
    does; if the node is gone, how to continue the run on another one."""
    run = state.get("run_dir") or "RUN_DIR"
    node = state["controller"]
    return UserError(f"controller node {node} ({state.get('host', '?')}) does not answer: {why.rstrip(' .;')}; the run goes on "
                     f"there if the node does: try again later; if {node} is gone, continue the run from its newest "
                     f"checkpoint on another node: {continue_command(state, run)}")


def _executor(state: dict[str, Any]):
    from vpscluster.cluster.inventory import executor_for, load_cluster

    cluster = load_cluster(state["cluster"])
    try:
        node = cluster.node(state["controller"])
    except KeyError:
        raise UserError(f"the run's controller node {state['controller']} is no longer in {state['cluster']}; "
                        "put it back to reach the run") from None
    return executor_for(node, cluster)


def remote_cli(state: dict[str, Any], argv: list[str], timeout_s: float,
               on_line: Callable[[str, str], None] | None = None) -> int:
    """Run `vpscluster ARGV` on the run's controller node over the user's SSH; its lines go to
    `on_line` (default: printed here, stdout and stderr kept apart). Returns its exit status."""
    import sys

    def show(stream: str, line: str) -> None:
        print(line, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    async def go() -> int:
        ex = _executor(state)
        try:
            r = await ex.stream(remote_command(state, argv), on_line or show, timeout_s=timeout_s)
        finally:
            await ex.close()
        if r.error or r.timed_out:
            raise no_answer(state, r.reason())
        return int(r.exit_status or 0)

    return asyncio.run(go())


def fetch(run_dir: Path, state: dict[str, Any], names=FETCHED, timeout_s: float = 120.0) -> list[str]:
    """Copy the controller's files `names` (those it has) into the local run dir; the names copied."""

    async def go() -> list[str]:
        ex = _executor(state)
        got = []
        try:
            for name in names:
                remote = posixpath.join(state["remote_run_dir"], name)
                r = await ex.run(["test", "-f", remote], timeout_s=timeout_s)
                if r.error or r.timed_out:
                    raise no_answer(state, r.reason())
                if r.ok:
                    await ex.get(remote, str(Path(run_dir) / name), timeout_s=timeout_s)
                    got.append(name)
        finally:
            await ex.close()
        return got

    return asyncio.run(go())
