"""A Dask distributed cluster on the vpscluster nodes: scheduler on the head, workers everywhere.

Started through the project's executors (local processes, or SSH with verified host keys), as
launch starts torchrun: the package and the user's code are synced by content hash to nodes
elsewhere, every process carries `VPSC_LAUNCH_ID=<job id>`, and `launch.teardown` ends and
verifies them all at the end, whatever ended the job. Workers are sized from the node: one
single-threaded worker process per usable core (cgroup quota or CPUs, rounded, at least one),
so CPU-bound Python functions are not held back by the GIL, and a worker killed with kill -9
loses only its own partition. `--death-timeout` makes a worker whose scheduler vanished exit.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from dataclasses import dataclass, field

from vpscluster.errors import RemoteError, UserError, one_line
from vpscluster.launch.commands import LAUNCH_ID_ENV, shell_path


@dataclass
class NodeWorkers:
    name: str
    address: str
    cores: float
    slots: int
    gpus: int = 0


@dataclass
class DaskCluster:
    scheduler_address: str
    nodes: dict[str, NodeWorkers]
    head: str = ""
    handles: list = field(default_factory=list)
    log_files: list = field(default_factory=list)
    log_dir: str = ""
    code_dirs: dict[str, str | None] = field(default_factory=dict)  # node -> the user's code there
    params: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> function arguments there
    # Where this machine's client reaches the scheduler; "" = scheduler_address. Differs over an
    # overlay: the nodes talk over the mesh, the controller (not on it) through an SSH tunnel to
    # the head (`tunnels`: the forwarded ports, closed by `stop`).
    client_address: str = ""
    tunnels: list = field(default_factory=list)

    def node_of(self, worker_name: str) -> str:
        return worker_name.rsplit("/", 1)[0]


def _env_prefix(env: dict[str, str]) -> str:
    import shlex

    return "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def _command(cwd: str, env: dict[str, str], argv: list[str]) -> str:
    import shlex

    return f"cd {shell_path(cwd)} && exec {_env_prefix(env)} {shlex.join(argv)}"


async def start(cluster, executors, job_id: str, code_dir: str, *, workers_per_node: int | None,
                say, timeout_s: float, log_dir: str, params: dict[str, str] | None = None,
                ship: dict[str, str] | None = None) -> DaskCluster:
    """Sync code, start the scheduler and the workers; return once every worker has joined the
    scheduler (the caller's client checks that). Processes started so far are in `.handles`
    even when this raises, so the caller's teardown covers a half-finished start.

    `ship` names files the function needs (parameter -> local path, e.g. a checkpoint): they are
    synced like the code, and the parameter holds each node's own path to its copy."""
    from vpscluster.launch import preflight as pf
    from vpscluster.launch.pipeline import SyncItem, local_side
    from vpscluster.launch.sync import PACKAGE_ON_NODE, package_dir, scan, sync_dir

    from vpscluster.cluster.netsafety import require_firewall

    by_name = {ex.node.name: ex for ex in executors}
    user_files = scan(code_dir)  # the user's folder less its caches and secrets (id_*, *.pem, .env, .ssh/ ...)
    if not all(ex.node.local for ex in executors):
        say(user_files.summary("sync code:"))
    workdirs = await pf.resolve_workdirs(executors, timeout_s)
    await require_firewall(cluster, executors, timeout_s)  # public nodes: the firewall must be up
    endpoints = pf.node_endpoints(cluster)  # the overlay's addresses once provisioned, as train and run
    package = package_dir()
    code_dirs: dict[str, str | None] = {}
    pythonpath: dict[str, str] = {}
    node_params: dict[str, dict[str, str]] = {n.name: dict(params or {}) for n in cluster.nodes}

    async def sync(ex) -> None:
        node = ex.node
        if node.local:
            code_dirs[node.name] = code_dir
            pythonpath[node.name] = os.pathsep.join([code_dir, os.path.dirname(package)])
            node_params[node.name].update({k: os.path.abspath(v) for k, v in (ship or {}).items()})
            return
        wd = workdirs[node.name]
        pkg = await sync_dir(ex, package, posixpath.join(wd, PACKAGE_ON_NODE), timeout_s=max(timeout_s, 300.0),
                             say=say)
        user = await sync_dir(ex, code_dir, posixpath.join(wd, "code/batch", os.path.basename(code_dir.rstrip("/")) or "code"),
                              timeout_s=max(timeout_s, 300.0), manifest=user_files.manifest, say=say)
        code_dirs[node.name] = user.remote_path
        pythonpath[node.name] = f"{user.remote_path}:{posixpath.dirname(pkg.remote_path)}"
        for key, path in (ship or {}).items():
            root, manifest = local_side(SyncItem(key, path, ""))
            r = await sync_dir(ex, root, posixpath.join(wd, "code/batch-files", key), timeout_s=max(timeout_s, 300.0),
                               manifest=manifest, say=say)
            node_params[node.name][key] = posixpath.join(r.remote_path, os.path.basename(path))

    await asyncio.gather(*(sync(ex) for ex in executors))

    async def size(ex) -> NodeWorkers:
        if ex.node.local:  # this machine: no need to start an interpreter to ask
            from vpscluster.jobs.load import capacity

            cap = capacity()
        else:
            from vpscluster.jobs.load import CAPACITY_SHELL, capacity_from_shell

            r = await ex.run(CAPACITY_SHELL, timeout_s=timeout_s)
            if not r.ok:
                raise RemoteError(f"node {ex.node.name}: could not read its CPU capacity: {_reason(r)}")
            cap = capacity_from_shell(r.stdout)
            r = await ex.run([ex.node.python, "-m", "distributed.cli.dask_worker", "--version"], timeout_s=timeout_s)
            if not r.ok:
                raise RemoteError(f"node {ex.node.name}: Dask is not installed for {ex.node.python}; "
                                  "install it there: pip install 'dask[distributed]'")
            import distributed

            theirs = r.stdout.strip().rsplit(" ", 1)[-1]
            if theirs != distributed.__version__:
                say(f"warning: node {ex.node.name} has Dask {theirs}, this machine "
                    f"{distributed.__version__}; install the same version everywhere if workers misbehave")
        gpus = int(ex.node.labels.get("gpus", 0) or 0)
        slots = workers_per_node or cap["slots"]
        end = endpoints[ex.node.name]
        if end.via == "overlay":
            await pf.check_endpoint(ex, end, endpoints[cluster.head].address, timeout_s, cluster.source)
        return NodeWorkers(ex.node.name, end.address, cap["cores"], slots, gpus)

    nodes = {n.name: n for n in await asyncio.gather(*(size(ex) for ex in executors))}
    head = nodes[cluster.head]
    port = _free_port_here(head.address) if by_name[cluster.head].node.local else \
        await pf.free_port(by_name[cluster.head], head.address, timeout_s)
    dask = DaskCluster(f"tcp://{head.address}:{port}", nodes, cluster.head, code_dirs=code_dirs, params=node_params)
    # The scheduler listens on the head's cluster address only: the overlay's once provisioned
    # (Dask runs pickled code from whoever reaches it). This machine is not on the mesh, so its
    # client goes through an SSH tunnel to the head (connect() waits for the scheduler).
    listen = head.address
    head_ex = by_name[cluster.head]
    if endpoints[cluster.head].via == "overlay" and hasattr(head_ex, "forward_local"):
        tunnel = await head_ex.forward_local(head.address, port)
        dask.tunnels.append(tunnel)
        dask.client_address = f"tcp://127.0.0.1:{tunnel.get_port()}"
    dask.log_dir = log_dir
    os.makedirs(log_dir, exist_ok=True)

    def env_for(name: str) -> dict[str, str]:
        return {LAUNCH_ID_ENV: job_id, "PYTHONPATH": pythonpath[name], "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
                "PYTHONUNBUFFERED": "1"}

    def log_to(name: str):
        # Each node's scheduler/worker output goes to <log_dir>/<node>.log (Dask is chatty, and
        # its shutdown tracebacks are normal); the tail is shown when the workers do not join.
        path = os.path.join(log_dir, f"{name}.log")
        f = open(path, "a", encoding="utf-8")
        dask.log_files.append(f)

        def on_line(stream: str, line: str) -> None:
            f.write(line + "\n")
        return on_line

    # Dask serves its HTTP routes (health, metrics) even with --no-dashboard, by default on every
    # interface (0.0.0.0:8787): loopback only, on a free port.
    http = ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    sched = [by_name[cluster.head].node.python, "-m", "distributed.cli.dask_scheduler",
             "--host", listen, "--port", str(port), *http]
    dask.handles.append(await by_name[cluster.head].start(
        _command(workdirs[cluster.head], env_for(cluster.head), sched), on_line=log_to(cluster.head)))
    for name, n in nodes.items():
        ex = by_name[name]
        for i in range(n.slots):
            argv = [ex.node.python, "-m", "distributed.cli.dask_worker", dask.scheduler_address,
                    "--name", f"{name}/{i}", "--nthreads", "1", "--no-nanny", "--host", n.address,
                    *http, "--death-timeout", "60", "--memory-limit", "0",
                    "--local-directory", posixpath.join(workdirs[name], "dask-scratch")]
            if n.gpus:
                argv += ["--resources", f"GPU={n.gpus}"]
            dask.handles.append(await ex.start(_command(workdirs[name], env_for(name), argv), on_line=log_to(name)))
    return dask


async def connect(dask: DaskCluster, timeout_s: float):
    """An asynchronous Dask client, once every worker has joined (state "running").

    A connection the scheduler closes while the client starts or asks (a node starved of CPU
    misses Dask's handshake; "Stream is closed") is tried again until `timeout_s` has passed;
    then a one-line `RemoteError` names what was missing."""
    from distributed import Client

    address = dask.client_address or dask.scheduler_address
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    want = sum(n.slots for n in dask.nodes.values())
    client, have, last = None, [], ""
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                if client is None:
                    client = await asyncio.wait_for(Client(address, asynchronous=True, timeout=left,
                                                           set_as_default=False), left)
                info = await asyncio.wait_for(client.scheduler.identity(n_workers=-1), max(0.1, min(10.0, left)))
                workers = info.get("workers", {}).values()
                have = sorted(str(w.get("name")) for w in workers if w.get("status") == "running")
                if len(have) >= want:
                    return client
            except (OSError, asyncio.TimeoutError) as e:  # CommClosedError is an OSError
                last = one_line(e)
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        if client is None:
            raise RemoteError(f"could not connect to the Dask scheduler at {address} within {timeout_s:.0f} s "
                              f"({last or 'timed out'}); see the node logs in {dask.log_dir}")
        raise RemoteError(f"only {len(have)} of {want} Dask workers joined within {timeout_s:.0f} s "
                          f"({', '.join(have) or 'none'}); see the node logs in {dask.log_dir}")
    except BaseException:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 10)
            except Exception:  # gone already; teardown ends the processes
                pass
        raise


async def shutdown(client, dask: DaskCluster, timeout_s: float = 10.0) -> None:
    """Ask the scheduler and the workers to exit (quicker than signals); `stop` then verifies."""
    try:
        await asyncio.wait_for(client.shutdown(), timeout_s)
    except Exception:  # already gone, or not answering: teardown's signals do it
        pass
    try:
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in dask.handles)), timeout_s)
    except Exception:
        pass


async def stop(executors, dask: DaskCluster | None, job_id: str) -> list:
    """End every process of the job on every node and verify (launch's teardown)."""
    from vpscluster.launch.teardown import teardown

    try:
        return await teardown(executors, dask.handles if dask else [], job_id, grace_s=3.0)
    finally:
        for f in dask.log_files if dask else []:
            f.close()
        for tunnel in dask.tunnels if dask else []:
            tunnel.close()


def _reason(r) -> str:
    """One line: why a node command failed."""
    if r.error:
        return r.error
    if r.timed_out:
        return "timed out"
    lines = (r.stderr or r.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit status {r.exit_status}"


def _free_port_here(address: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def check_code_dir(code_dir: str) -> str:
    path = os.path.abspath(code_dir)
    if not os.path.isdir(path):
        raise UserError(f"--code {code_dir}: not a folder")
    return path
