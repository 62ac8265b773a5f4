"""The queue's small client: a synchronous face over nats-py's asyncio (JetStream).

    q = connect(cluster)                     # the server `queue up` started, or the cluster file's
    q.stream("acts", ["acts.>"])             # idempotent; on disk, with retention limits
    q.publish("acts.text", b"...", {"batch": "7"})          # -> the stream sequence, once stored
    c = q.consume("acts.text", durable="head", max_pending=8, ack_wait_s=30)
    for m in c.fetch(4, timeout_s=5):        # at most max_pending unacked at once (backpressure)
        ...; m.ack()                         # unacked (or m.nak()) -> delivered again
    q.close()

Pipelined use (nothing waits on a round trip in the caller's critical path):

    c.prefetch()                             # a background pull keeps up to max_pending ahead of fetch()
    w = InFlight(limit=32)                   # calls sent, confirmations checked later (in order)
    w.add(q.publish_nowait("acts.text", b"..."), "publish"); w.add(m.ack_nowait(), "ack")
    w.wait()                                 # every confirmation, or the first failure as QueueError

Checkpoints and other blobs go to the server's object store (JetStream Object Store, chunked):

    q.put_object("ckpt", "text", data, description='{"applied": 30}')   # or put_object_nowait
    q.get_object("ckpt", "text")             # (data, description), None when not there
    q.delete_bucket("ckpt")

Every call has a time-out (QueueError when it passes); callers never see asyncio: one event loop
runs in a daemon thread per `Queue`, and each call waits on it with its time-out. nats-py is
imported when connecting, so importing this module is cheap.

Streams are file-stored with `limits` retention and `discard: new`: a full stream refuses new
messages (a publisher gets QueueError, the backpressure of the producing side) rather than
dropping old ones nobody consumed. Consumers are durable pull consumers with explicit acks:
`max_pending` is their max_ack_pending (the server hands out no more unacked messages than that),
`ack_wait_s` how long an unacked message waits before it is delivered again, `max_deliver` how
often at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue as _queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vpscluster.errors import UserError

TIMEOUT_S = 10.0
URL_ENV, TOKEN_ENV, USER_ENV, PASSWORD_ENV = "VPSC_QUEUE_URL", "VPSC_QUEUE_TOKEN", "VPSC_QUEUE_USER", "VPSC_QUEUE_PASSWORD"
# Stream limits (per stream; all streams together are bounded by the server's store, queue/server.py)
MAX_AGE_S = 7 * 86400.0
MAX_MSGS = 10_000_000


class QueueError(UserError):
    """The queue refused, failed or did not answer in time (one line)."""


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str | None = None
    user: str | None = None
    password: str | None = None

    def env(self) -> dict[str, str]:
        """Environment variables a process on a node passes to `connect()` (secrets: do not log)."""
        out = {URL_ENV: self.url}
        for key, value in ((TOKEN_ENV, self.token), (USER_ENV, self.user), (PASSWORD_ENV, self.password)):
            if value:
                out[key] = value
        return out

    @classmethod
    def from_env(cls) -> Credentials | None:
        url = os.environ.get(URL_ENV)
        return None if not url else cls(url, os.environ.get(TOKEN_ENV), os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV))


@dataclass
class Message:
    subject: str
    data: bytes
    headers: dict[str, str]
    stream_seq: int
    num_delivered: int  # 1 on the first delivery, 2 on the first redelivery...
    _msg: Any = field(repr=False, default=None)
    _queue: Any = field(repr=False, default=None)

    def ack(self, timeout_s: float | None = None) -> None:
        """Acknowledge and wait for the server to confirm it (double ack): it will not come again."""
        self._queue._call(self._msg.ack_sync(timeout=timeout_s or self._queue.timeout_s), timeout_s, "ack")

    def ack_nowait(self, timeout_s: float | None = None) -> concurrent.futures.Future:
        """`ack` without waiting: the server's confirmation comes to the returned future (see InFlight)."""
        t = timeout_s or self._queue.timeout_s
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._msg.ack_sync(timeout=t), t + 1.0), self._queue._loop)

    def nak(self, delay_s: float | None = None, timeout_s: float | None = None) -> None:
        """Give it back now (or after `delay_s`): it is delivered again."""
        self._queue._call(self._msg.nak(delay=delay_s), timeout_s, "nak")

    def in_progress(self, timeout_s: float | None = None) -> None:
        """Still working on it: restart its ack_wait clock."""
        self._queue._call(self._msg.in_progress(), timeout_s, "in_progress")


class Consumer:
    def __init__(self, queue: Queue, sub, subject: str, durable: str):
        self._queue, self._sub, self.subject, self.durable = queue, sub, subject, durable
        self._ahead: _queue.Queue | None = None
        self.pump_error: str | None = None  # the background pull's last failure (it retries)

    def prefetch(self) -> None:
        """Keep pulling in the background, so `fetch` takes what already came instead of making a round
        trip. The server hands out at most max_pending unacked messages: that bounds how far ahead
        the pull gets. One message per request: a lingering pull for several returns only when all
        came or it expires, which would hold back the first."""
        import nats.errors

        if self._ahead is not None:
            return
        self._ahead = _queue.Queue()

        async def pump():
            while True:
                try:
                    msgs = await self._sub.fetch(1, timeout=5.0)
                except nats.errors.TimeoutError:
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a server restart, a lost connection: pull again once it is back
                    self.pump_error = str(e).strip() or type(e).__name__
                    await asyncio.sleep(0.2)
                    continue
                for m in msgs:
                    self._ahead.put(m)

        asyncio.run_coroutine_threadsafe(pump(), self._queue._loop)

    def fetch(self, n: int = 1, timeout_s: float | None = None) -> list[Message]:
        """Up to `n` messages, waiting at most `timeout_s` for the first; [] when none came."""
        import nats.errors

        t = timeout_s or self._queue.timeout_s
        if self._ahead is not None:
            try:
                msgs = [self._ahead.get(timeout=t)]
            except _queue.Empty:
                return []
            while len(msgs) < n:
                try:
                    msgs.append(self._ahead.get_nowait())
                except _queue.Empty:
                    break
            return [self._wrap(m) for m in msgs]

        async def go():
            try:
                return await self._sub.fetch(n, timeout=t)
            except nats.errors.TimeoutError:
                return []

        msgs = self._queue._call(go(), t + 5.0, f"fetch from {self.subject}")
        return [self._wrap(m) for m in msgs]

    def _wrap(self, m) -> Message:
        return Message(m.subject, m.data, dict(m.headers or {}), m.metadata.sequence.stream, m.metadata.num_delivered, m,
                       self._queue)

    def info(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The server's view: num_pending (lag: stored, not yet delivered), num_ack_pending, num_redelivered."""
        i = self._queue._call(self._sub.consumer_info(), timeout_s, "consumer info")
        return {"num_pending": i.num_pending, "num_ack_pending": i.num_ack_pending, "num_redelivered": i.num_redelivered,
                "delivered": i.delivered.stream_seq, "ack_floor": i.ack_floor.stream_seq}


class Queue:
    """One connection to the queue; every call waits at most its time-out (default `timeout_s`)."""

    def __init__(self, creds: Credentials, timeout_s: float = TIMEOUT_S, name: str = "vpscluster"):
        self.creds, self.timeout_s = creds, timeout_s
        self._last_error: BaseException | None = None
        self._buckets: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vpsc-queue", daemon=True)
        self._thread.start()
        try:
            self._nc = self._call(self._connect(name), timeout_s + 1.0, f"connect to {creds.url}")
        except BaseException:
            self._stop_loop()
            raise
        self._js = self._nc.jetstream(timeout=timeout_s)

    async def _connect(self, name: str):
        import nats

        refused = asyncio.get_running_loop().create_future()

        async def on_error(e):  # errors reach the caller as QueueError, not as tracebacks on stderr
            self._last_error = e
            if "authorization" in str(e).lower() and not refused.done():  # a wrong token: no point retrying
                refused.set_exception(e)

        c = self.creds
        task = asyncio.ensure_future(nats.connect(
            c.url, token=c.token, user=c.user, password=c.password, name=name, connect_timeout=self.timeout_s,
            allow_reconnect=True, max_reconnect_attempts=60, reconnect_time_wait=1.0, error_cb=on_error))
        await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return refused.result()  # raises the server's refusal

    def _call(self, coro, timeout_s: float | None, what: str):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        t = timeout_s or self.timeout_s
        try:
            return fut.result(timeout=t)
        except TimeoutError:
            fut.cancel()
            last = f"; last error: {str(self._last_error).strip() or type(self._last_error).__name__}" if self._last_error else ""
            raise QueueError(f"queue: {what} did not finish within {t:.0f} s ({self.creds.url}{last})") from None
        except QueueError:
            raise
        except Exception as e:  # nats' own errors, as one line
            text = str(e).strip() or type(e).__name__
            raise QueueError(f"queue: {what} failed: {text} ({self.creds.url})") from None

    def stream(self, name: str, subjects: list[str], *, max_age_s: float = MAX_AGE_S, max_msgs: int = MAX_MSGS,
               max_bytes: int | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """Create the stream (or update its limits): stored on disk, messages kept at most `max_age_s`
        and `max_msgs`; `max_bytes` (None: the server's whole store, `queue up --max-store`) is
        reserved out of that store when given, so leave it None unless a stream must not crowd others."""
        from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

        cfg = StreamConfig(name=name, subjects=list(subjects), storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                           discard=DiscardPolicy.NEW, max_bytes=-1 if max_bytes is None else int(max_bytes), max_age=float(max_age_s),
                           max_msgs=int(max_msgs))

        async def go():
            import nats.js.errors

            try:
                info = await self._js.add_stream(cfg)
            except nats.js.errors.BadRequestError:  # exists with other settings: update its limits
                info = await self._js.update_stream(cfg)
            return {"name": info.config.name, "subjects": info.config.subjects, "messages": info.state.messages}

        return self._call(go(), timeout_s, f"create stream {name}")

    def delete_stream(self, name: str, timeout_s: float | None = None) -> bool:
        """Remove a stream and its messages; False when there was none."""

        async def go():
            import nats.js.errors

            try:
                return await self._js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                return False

        return bool(self._call(go(), timeout_s, f"delete stream {name}"))

    def delete_consumer(self, stream: str, durable: str, timeout_s: float | None = None) -> bool:
        """Remove a durable consumer (what it delivered and what was acked); False when there was none.
        A consumer made again under that name gets the stream from its start."""

        async def go():
            import nats.js.errors

            try:
                return await self._js.delete_consumer(stream, durable)
            except nats.js.errors.NotFoundError:
                return False

        return bool(self._call(go(), timeout_s, f"delete consumer {durable} of {stream}"))

    # ---- object store (JetStream Object Store: a bucket of named blobs, chunked, on the server's disk)

    async def _bucket(self, bucket: str, create: bool = False):
        """The bucket (bound once per connection); made on the server's disk when `create` and missing
        (else nats' BucketNotFoundError)."""
        import nats.js.errors
        from nats.js.api import ObjectStoreConfig, StorageType

        if bucket not in self._buckets:
            try:
                self._buckets[bucket] = await self._js.object_store(bucket)
            except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
                if not create:
                    raise
                self._buckets[bucket] = await self._js.create_object_store(
                    bucket, config=ObjectStoreConfig(storage=StorageType.FILE))
        return self._buckets[bucket]

    def put_object_nowait(self, bucket: str, name: str, data: bytes,
                          description: str | None = None) -> concurrent.futures.Future:
        """Store `data` as `name` in `bucket` (made when missing), replacing what was there, without
        waiting: the server's confirmation comes to the returned future (see InFlight)."""
        from nats.js.api import ObjectMeta

        async def go():
            obs = await self._bucket(bucket, create=True)
            return await obs.put(name, data, meta=ObjectMeta(name=name, description=description))

        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(go(), self.timeout_s), self._loop)

    def put_object(self, bucket: str, name: str, data: bytes, description: str | None = None,
                   timeout_s: float | None = None) -> None:
        t = timeout_s or self.timeout_s
        try:
            self.put_object_nowait(bucket, name, data, description).result(timeout=t + 1.0)
        except Exception as e:
            raise QueueError(f"queue: storing {bucket}/{name} failed: {str(e).strip() or type(e).__name__} "
                             f"({self.creds.url})") from None

    def get_object(self, bucket: str, name: str, timeout_s: float | None = None) -> tuple[bytes, str | None] | None:
        """(data, description) of `name` in `bucket`; None when the bucket or the object is not there."""

        async def go():
            import nats.js.errors

            try:
                obs = await self._bucket(bucket)
                res = await obs.get(name)
            except (nats.js.errors.NotFoundError, nats.js.errors.ObjectNotFoundError, nats.js.errors.BucketNotFoundError):
                return None
            return res.data, res.info.description

        return self._call(go(), timeout_s, f"read {bucket}/{name}")

    def object_description(self, bucket: str, name: str, timeout_s: float | None = None) -> str | None:
        """The description stored with `name` (without its data); None when there is no such object."""

        async def go():
            import nats.js.errors

            try:
                obs = await self._bucket(bucket)
                return (await obs.get_info(name)).description
            except (nats.js.errors.NotFoundError, nats.js.errors.ObjectNotFoundError, nats.js.errors.BucketNotFoundError):
                return None

        return self._call(go(), timeout_s, f"look up {bucket}/{name}")

    def delete_bucket(self, bucket: str, timeout_s: float | None = None) -> bool:
        """Remove an object store bucket and everything in it; False when there was none."""
        self._buckets.pop(bucket, None)
        return self.delete_stream(f"OBJ_{bucket}", timeout_s)

    def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                timeout_s: float | None = None) -> int:
        """Store one message; returns its stream sequence once the server has it on disk."""
        t = timeout_s or self.timeout_s
        ack = self._call(self._js.publish(subject, data, timeout=t, headers=headers), t + 1.0, f"publish to {subject}")
        return ack.seq

    def publish_nowait(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                       timeout_s: float | None = None) -> concurrent.futures.Future:
        """`publish` without waiting: sent in call order on this connection; the stream sequence (or
        the failure) comes to the returned future once the server has stored it (see InFlight)."""
        t = timeout_s or self.timeout_s
        return asyncio.run_coroutine_threadsafe(self._js.publish(subject, data, timeout=t, headers=headers), self._loop)

    def consume(self, subject: str, durable: str, max_pending: int = 64, ack_wait_s: float = 30.0,
                max_deliver: int = -1, timeout_s: float | None = None) -> Consumer:
        """A durable pull consumer of `subject` (created, or bound again after a restart)."""
        from nats.js.api import AckPolicy, ConsumerConfig

        cfg = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=int(max_pending),
                             ack_wait=float(ack_wait_s), max_deliver=int(max_deliver))
        sub = self._call(self._js.pull_subscribe(subject, durable=durable, config=cfg), timeout_s,
                         f"consume {subject} as {durable}")
        return Consumer(self, sub, subject, durable)

    def streams(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every stream with its counts, and each consumer's lag (stored, not yet delivered to it)."""

        async def go():
            out = []
            for s in await self._js.streams_info():
                consumers = [{"name": c.name, "lag": c.num_pending or 0, "ack_pending": c.num_ack_pending or 0,
                              "redelivered": c.num_redelivered or 0, "max_pending": c.config.max_ack_pending}
                             for c in await self._js.consumers_info(s.config.name)]
                out.append({"name": s.config.name, "subjects": list(s.config.subjects or []), "messages": s.state.messages,
                            "bytes": s.state.bytes, "first_seq": s.state.first_seq, "last_seq": s.state.last_seq,
                            "consumers": sorted(consumers, key=lambda c: c["name"])})
            return sorted(out, key=lambda s: s["name"])

        return self._call(go(), timeout_s, "list streams")

    def close(self, timeout_s: float | None = None) -> None:
        try:
            if not self._nc.is_closed:
                # close, not drain: publishes and acks were confirmed when made, and a pull
                # subscription's inbox may hold a late message nobody fetched (drain waits on it)
                self._call(self._nc.close(), timeout_s, "close")
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(timeout=5.0)
        except Exception:  # closing: what could not be cancelled goes with the daemon thread
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InFlight:
    """Queue calls sent without waiting (`publish_nowait`, `ack_nowait`), at most `limit` unconfirmed:
    adding one more waits for the oldest. A failure is raised (QueueError, one line) by the `add` or
    `wait` that meets it, so nothing fails silently; `wait()` at the end confirms every call."""

    def __init__(self, limit: int = 64, timeout_s: float = TIMEOUT_S):
        self.limit, self.timeout_s = max(1, limit), timeout_s
        self._calls: deque[tuple[concurrent.futures.Future, str, float]] = deque()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, fut: concurrent.futures.Future, what: str) -> None:
        self._calls.append((fut, what, time.monotonic()))
        while self._calls and (len(self._calls) > self.limit or self._calls[0][0].done()):
            self._settle(*self._calls.popleft())

    def wait(self) -> None:
        while self._calls:
            self._settle(*self._calls.popleft())

    def _settle(self, fut: concurrent.futures.Future, what: str, since: float) -> None:
        left = self.timeout_s + 2.0 - (time.monotonic() - since)
        try:
            fut.result(timeout=max(0.1, left))
        except (TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError):
            fut.cancel()
            raise QueueError(f"queue: {what} was not confirmed within {self.timeout_s:.0f} s") from None
        except concurrent.futures.CancelledError:
            raise QueueError(f"queue: {what} was cancelled (the connection closed)") from None
        except Exception as e:
            raise QueueError(f"queue: {what} failed: {str(e).strip() or type(e).__name__}") from None


def connect(cluster=None, *, creds: Credentials | None = None, timeout_s: float = TIMEOUT_S) -> Queue:
    """The queue of `cluster` (its `queue:` server, else the one `queue up` started), `creds` as
    given, or, with neither, the VPSC_QUEUE_* environment a launch passes to its processes."""
    if creds is None and cluster is not None:
        from vpscluster.queue.server import credentials

        creds = credentials(cluster)
    if creds is None:
        creds = Credentials.from_env()
    if creds is None:
        raise UserError(f"queue: no server known; start one with `vpscluster queue up`, or set {URL_ENV}")
    return Queue(creds, timeout_s=timeout_s)
