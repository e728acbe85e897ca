"""The connection to the NATS JetStream cluster and what cluster mode keeps in it: S streams of
batches (the history, retention_s), and the KV buckets of marks, fleet summaries, partition
leases and series definitions. `ensure()` finds them; a gateway's (`create=True`, the only identity allowed to:
nats_auth.py) also creates what is missing and updates what differs (the same config gives the
same streams); workers, scheduler replicas and exporters wait for them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import nats
import nats.js.errors
from nats.js import api

from .subjects import stream_name, stream_subjects

log = logging.getLogger("xpusense.collector.cluster")


async def connect(ncfg: Any, name: str, on_state=None, timeout_s: float = 10.0, role: str = ""):
    """A client connection to the cluster that keeps reconnecting (to any of `urls`) for ever;
    `on_state(connected: bool)` is called when it goes and comes back. `role` (nats_auth.ROLES):
    whose certificate (`{role}` in [nats] tls_cert/tls_key/creds_file) and inbox it uses."""
    from .config import role_files
    from .nats_auth import inbox_prefix
    files = role_files(ncfg, role or "{role}")   # ConfigError: a named key's file is missing
    opts: dict[str, Any] = dict(servers=list(ncfg.urls), name=name, connect_timeout=2, reconnect_time_wait=0.25,
                                max_reconnect_attempts=-1, allow_reconnect=True, ping_interval=5, max_outstanding_pings=2,
                                pending_size=64 * 2**20,
                                # A drain (disconnect(), at stop) of a server that goes meanwhile: nats-py
                                # would wait its flush's 10 s; this bounds the whole drain.
                                drain_timeout=ncfg.publish_timeout_s)
    if role:
        opts["inbox_prefix"] = inbox_prefix(role)   # the only replies its identity may receive
    if files["creds_file"]:
        opts["user_credentials"] = files["creds_file"]
    if files["tls_ca"] or files["tls_cert"]:
        import ssl
        ctx = ssl.create_default_context(cafile=files["tls_ca"] or None)
        if files["tls_cert"]:
            try:
                ctx.load_cert_chain(files["tls_cert"], files["tls_key"])
            except (ssl.SSLError, ValueError) as e:
                raise ClusterUnavailable(f"[nats] tls_cert {files['tls_cert']} / tls_key {files['tls_key']}: "
                                         f"not a certificate and its key: {e}") from None
        opts["tls"] = ctx

    async def error_cb(e: Exception) -> None:
        log.debug("nats: %s", e)

    client: list = []   # the connection, once made: its callbacks tell a close from a lost server

    async def disconnected_cb() -> None:
        # nats-py calls this on close() too (status CLOSED): that is no lost server, and no reconnect follows.
        if client and client[0].is_closed:
            log.info("nats: connection closed")
        else:
            log.warning("nats: disconnected from the cluster; reconnecting")
        if on_state is not None:
            on_state(False)

    async def reconnected_cb() -> None:
        log.info("nats: reconnected")
        if on_state is not None:
            on_state(True)

    opts.update(error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb)
    try:   # the client retries the servers itself; bounded here so a wrong address fails at start
        nc = await asyncio.wait_for(nats.connect(**opts), timeout_s)
    except Exception as e:
        hint = "is it running? set [nats] urls / --nats"
        if "authorization" in str(e).lower() or "certificate" in str(e).lower():
            hint = (f"the servers refused this client's identity{f' (role {role})' if role else ''}: set [nats] "
                    f"tls_cert / tls_key to its role's certificate (`xpusense-collector certs --nats DIR`)")
        raise ClusterUnavailable(f"cannot reach the NATS cluster at {','.join(ncfg.urls)}: "
                                 f"{type(e).__name__} {e}; {hint}") from None
    client.append(nc)
    return nc


async def disconnect(nc: Any) -> None:
    """A stopping process's last word to the cluster: drain the connection (its subscriptions and
    the publishes in flight finish, then it closes), or, when there is no server to drain to
    (reconnecting: the cluster is down) or the drain fails, close it at once. nats-py's drain()
    refuses a reconnecting connection; and its close can wait for ever on a socket whose TLS
    handshake a dying server cut short. Each step is bounded by the drain timeout ([nats]
    publish_timeout_s); past it the socket is dropped."""
    if nc.is_closed:
        return
    bound_s = float(nc.options.get("drain_timeout") or 5.0)
    if nc.is_connected and not nc.is_draining:
        try:
            await asyncio.wait_for(nc.drain(), 2 * bound_s)
            return
        except Exception as e:   # TimeoutError included
            log.debug("nats: drain: %s; closing instead", type(e).__name__)
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), bound_s)
    except TimeoutError:
        log.warning("nats: the connection did not close within %.0f s; its socket is dropped", bound_s)
        _drop_socket(nc)
    except Exception as e:
        log.debug("nats: close: %s", e)


def _drop_socket(nc: Any) -> None:
    """Abort the socket under a nats-py client whose close is stuck (its status is CLOSED by then),
    if it still has one: nats-py keeps it as `_transport._io_writer`, an asyncio StreamWriter."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()


class ClusterUnavailable(Exception):
    pass


@dataclass
class Buckets:
    marks: Any
    fleet: Any
    leases: Any
    series: Any = None   # the compact encoding's series definitions (series_defs.py)


async def ensure(js, ncfg: Any, timeout_s: float = 60.0, create: bool = True) -> Buckets:
    """Streams and buckets as `ncfg` says (retried while the cluster elects leaders). Not `create`:
    only look them up, waiting up to `timeout_s` for a gateway to make them."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await _ensure(js, ncfg, create)
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError, nats.js.errors.APIError,
                nats.errors.NoRespondersError) as e:
            if asyncio.get_running_loop().time() > deadline:
                what = "set up" if create else "find (a gateway, `xpusense-collector serve --nats`, creates them)"
                raise ClusterUnavailable(f"cannot {what} the streams and buckets in the NATS cluster: {e}") from None
            log.info("nats: %s streams and buckets: %s; trying again", "setting up" if create else "waiting for", e)
            await asyncio.sleep(0.5)


def stream_config(ncfg: Any, index: int) -> api.StreamConfig:
    return api.StreamConfig(
        name=stream_name(ncfg.prefix, index),
        description="xpusense batches (cluster mode): the fleet's history",
        subjects=stream_subjects(ncfg.prefix, index, ncfg.partitions, ncfg.streams),
        retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD,
        max_age=float(ncfg.retention_s), max_bytes=ncfg.max_bytes or -1,
        storage=api.StorageType.FILE if ncfg.storage == "file" else api.StorageType.MEMORY,
        num_replicas=ncfg.replicas, duplicate_window=float(ncfg.duplicate_window_s),
        allow_direct=True,
    )


async def _ensure(js, ncfg: Any, create: bool) -> Buckets:
    for i in range(ncfg.streams):
        want = stream_config(ncfg, i)
        try:
            have = await js.stream_info(want.name)
        except nats.js.errors.NotFoundError:
            if not create:
                raise
            await js.add_stream(want)
            continue
        if not create:
            continue
        c = have.config
        if (sorted(c.subjects or []) != sorted(want.subjects or []) or c.max_age != want.max_age
                or c.duplicate_window != want.duplicate_window or (c.max_bytes or -1) != want.max_bytes
                or c.num_replicas != want.num_replicas):
            log.info("nats: updating stream %s to the configuration", want.name)
            await js.update_stream(want)
    storage = api.StorageType.FILE if ncfg.storage == "file" else api.StorageType.MEMORY
    kvs = []
    for bucket, ttl, marker, max_bytes in ((ncfg.marks_bucket, ncfg.marks_ttl_s, None, -1),
                                           (ncfg.fleet_bucket, ncfg.node_ttl_s, max(1.0, ncfg.summary_s), -1),
                                           (ncfg.leases_bucket, ncfg.lease_s, 1.0, -1),
                                           (ncfg.series_bucket, ncfg.series_ttl_s, None, ncfg.series_max_bytes)):
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                raise
            kv = await js.create_key_value(bucket=bucket, history=1, ttl=float(ttl), replicas=ncfg.replicas,
                                           storage=storage, direct=True, limit_marker_ttl=marker,
                                           max_bytes=max_bytes)
        kvs.append(kv)
    return Buckets(*kvs)


async def list_bucket(js, bucket: str, keys: str = ">", timeout_s: float = 30.0) -> list[tuple[str, bytes, int]]:
    """Every live key of a KV bucket (matching `keys`) with its value and revision: a one-off
    consumer of the bucket's stream, last message per subject, read until nothing is pending. (The
    client's KV watcher may say 'no more' before it handed over what it already received.)"""
    stream, pre = f"KV_{bucket}", f"$KV.{bucket}."
    sub = await js.pull_subscribe(f"{pre}{keys}", durable=None, stream=stream, config=api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT, ack_policy=api.AckPolicy.NONE, mem_storage=True,
        num_replicas=1, inactive_threshold=30.0))
    out: list[tuple[str, bytes, int]] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        pending = (await sub.consumer_info()).num_pending
        while pending > 0:
            if asyncio.get_running_loop().time() > deadline:
                raise nats.errors.TimeoutError
            try:
                msgs = await sub.fetch(batch=min(pending, 1000), timeout=2.0)
            except nats.js.errors.ServiceUnavailableError:
                await asyncio.sleep(0.1)
                continue
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for m in msgs:
                pending = m.metadata.num_pending
                op = (m.headers or {}).get("KV-Operation") or (m.headers or {}).get("Nats-Marker-Reason")
                if not op and m.data:
                    out.append((m.subject[len(pre):], m.data, m.metadata.sequence.stream))
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    return out
