"""`engine.connect` against a real Dask scheduler and worker on this machine, reached through a
TCP relay that closes connections the way a starved scheduler does (it misses Dask's handshake
and drops the stream: "Stream is closed").

Dropped connections are tried again within the time-out; a scheduler that never answers, or
workers that never join, end in one line that names what was missing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from vpscluster.errors import RemoteError
from vpscluster.jobs.engine import DaskCluster, NodeWorkers, connect


def _dask(address: str, slots: int) -> DaskCluster:
    return DaskCluster(address, {"n1": NodeWorkers("n1", "127.0.0.1", 1.0, slots)}, "n1", log_dir="/tmp/node-logs")


async def _relay(drop: int, target: tuple[str, int] | None):
    """A TCP relay on loopback: the first `drop` connections (all, without a target) are closed
    at once; the others are forwarded to `target`. Returns (server, port, connections seen)."""
    seen = []

    async def pipe(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer) -> None:
        seen.append(time.monotonic())
        if target is None or len(seen) <= drop:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.timeout(60)
def test_dropped_connections_are_tried_again_until_every_worker_has_joined():
    from distributed import Scheduler, Worker

    async def main():
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s, \
                Worker(s.address, nthreads=1, name="n1/0"):
            server, port, seen = await _relay(drop=3, target=("127.0.0.1", _port(s.address)))
            async with server:
                client = await connect(_dask(f"tcp://127.0.0.1:{port}", slots=1), timeout_s=30)
                try:
                    workers = (await client.scheduler.identity(n_workers=-1))["workers"].values()
                    names = [w["name"] for w in workers]
                finally:
                    await client.close()
            return names, len(seen)

    names, connections = asyncio.run(main())
    assert names == ["n1/0"]
    assert connections > 3  # the three dropped ones, then the ones that got through


@pytest.mark.timeout(60)
def test_a_scheduler_that_drops_every_connection_is_one_line_within_the_time_out():
    async def main():
        server, port, seen = await _relay(drop=0, target=None)
        async with server:
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as e:
                await connect(_dask(f"tcp://127.0.0.1:{port}", slots=1), timeout_s=4)
            return str(e.value), time.monotonic() - t0, port, len(seen)

    message, took, port, connections = asyncio.run(main())
    assert message.startswith(f"could not connect to the Dask scheduler at tcp://127.0.0.1:{port} within 4 s (")
    assert message.endswith("see the node logs in /tmp/node-logs")
    assert "\n" not in message
    assert connections >= 1
    assert took < 4 + 12  # the deadline, plus one bounded close


@pytest.mark.timeout(60)
def test_workers_that_never_join_are_named_within_the_time_out():
    from distributed import Scheduler, Worker

    async def main():
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s, \
                Worker(s.address, nthreads=1, name="n1/0"):
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as e:
                await connect(_dask(s.address, slots=2), timeout_s=3)
            return str(e.value), time.monotonic() - t0

    message, took = asyncio.run(main())
    assert message == "only 1 of 2 Dask workers joined within 3 s (n1/0); see the node logs in /tmp/node-logs"
    assert took < 3 + 12
