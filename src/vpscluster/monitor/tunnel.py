"""Reach a service that listens only on a node's overlay address from this machine, which is not
on the mesh: an SSH local port forward through that node's connection (the node's sshd connects
to the address, so nothing listens beyond the overlay and no new port is opened).

    with Tunnel(cluster, "node-1", "10.77.0.1", 9090) as t:
        urllib.request.urlopen(f"http://127.0.0.1:{t.port}/-/ready")

The forward lives in a background thread with its own event loop, so synchronous callers
(Prometheus queries in `top`, `report`, batch's load figures) use it as a plain local port.
"""

from __future__ import annotations

import asyncio
import threading

from vpscluster.errors import RemoteError


class Tunnel:
    """127.0.0.1:`port` on this machine reaches `host:port` as node `node` sees it, until `close()`."""

    def __init__(self, cluster, node: str, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.cluster, self.node, self.host, self.remote_port, self.timeout_s = cluster, node, host, port, timeout_s
        self.port: int | None = None
        self._error: str | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True,
                                        name=f"vpsc-tunnel-{node}")
        self._thread.start()
        if not self._ready.wait(timeout_s + 10.0):
            raise RemoteError(f"node {node}: no SSH tunnel to {host}:{port} within {timeout_s:.0f} s")
        if self._error:
            raise RemoteError(self._error)

    async def _serve(self) -> None:
        from vpscluster.cluster.inventory import executor_for

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        ex = executor_for(self.cluster.node(self.node), self.cluster)
        try:
            try:
                listener = await asyncio.wait_for(ex.forward_local(self.host, self.remote_port), self.timeout_s)
            except Exception as e:  # RemoteError, asyncssh's errors, the time-out: one line for the caller
                self._error = (f"node {self.node}: could not open an SSH tunnel to {self.host}:{self.remote_port}: "
                               f"{str(e).strip() or type(e).__name__}")
                return
            self.port = listener.get_port()
            self._ready.set()
            await self._stop.wait()
            listener.close()
        finally:
            self._ready.set()
            await ex.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has just ended
                pass
        self._thread.join(10.0)

    def __enter__(self) -> "Tunnel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
