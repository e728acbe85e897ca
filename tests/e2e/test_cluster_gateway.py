"""Cluster mode, the gateway, with real processes: a real agent streams through
`serve --nats` into a real 3-server JetStream cluster. Each batch is in the stream once under its
message id node:boot:seq; the agent's Ack comes only after JetStream's publish ack (what an agent
forgot is stored, also across a lost quorum); the marks bucket carries Welcome across gateways."""

from __future__ import annotations

import re
import signal
import time

from cluster_support import (  # noqa: F401
    check_exactly_once,
    cluster_config,
    connect_as,
    nats_cluster,
    run,
    start_gateway,
    stream_ids,
)
from helpers import BIN, FAST_HOST_ONLY, free_port, wait_until

from xpusense.agent.spool.peek import unacked


def _agent(procs, tmp_path, addr, node, name="agent"):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(FAST_HOST_ONLY)
    return procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", node], name)


def _highs(cluster, node):
    ids = stream_ids(cluster)
    return {boot: high for (n, boot), high in check_exactly_once(ids).items() if n == node}


def _mark(cluster, node, boot):
    from xpusense.collector.cluster.subjects import mark_key

    async def get():
        nc = await connect_as(cluster, "gateway")
        try:
            kv = await nc.jetstream(timeout=10).key_value("marks")
            return int((await kv.get(mark_key(node, boot))).value)
        finally:
            await nc.close()
    return run(get())


def test_agent_through_gateways_exactly_once(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    port = free_port()
    gw, addr = start_gateway(procs, cfg, "gateway-a", port)
    node = "gpu-1.dc.example"   # dots: escaped in the subject and the KV key
    agent = _agent(procs, tmp_path, addr, node)
    highs = wait_until(lambda: (h := _highs(nats_cluster, node)) and max(h.values()) >= 20 and h, 90,
                       what="20 batches in the stream")
    (boot, _), = highs.items()
    gw.kill(signal.SIGKILL)                      # mid-stream: acks in flight are lost, the agent resends
    before = max(_highs(nats_cluster, node).values())
    gw2, _ = start_gateway(procs, cfg, "gateway-b", port)
    wait_until(lambda: max(_highs(nats_cluster, node).values()) >= before + 20, 90, what="streaming again")
    wait_until(lambda: _mark(nats_cluster, node, boot) >= before, 30, what="the mark in the marks bucket")
    agent.kill(signal.SIGTERM)
    gw2.kill(signal.SIGTERM)                      # flushes its marks
    highs = _highs(nats_cluster, node)           # every seq 1..high once (check_exactly_once asserts it)
    assert list(highs) == [boot]
    assert _mark(nats_cluster, node, boot) == highs[boot]
    # gateway-b knew nothing of this boot: its Welcome's stored_up_to came from the marks bucket.
    welcomed = [int(m) for m in re.findall(rf"node {re.escape(node)} connected .* stored up to (\d+)", gw2.output())]
    assert welcomed and 0 < welcomed[0] <= before


def test_acks_only_after_jetstream_stored(nats_cluster, procs, tmp_path, own_spool_dir):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    gw, addr = start_gateway(procs, cfg)
    node = "quorum-node"
    agent = _agent(procs, tmp_path, addr, node)
    wait_until(lambda: max(_highs(nats_cluster, node).values(), default=0) >= 10, 90, what="10 batches stored")
    nats_cluster.kill("n2")
    nats_cluster.kill("n3")                      # no quorum: nothing can be stored, so nothing may be acked
    time.sleep(3.0)                              # the agent keeps producing into its spool meanwhile
    agent.kill(signal.SIGKILL)
    left = unacked(str(own_spool_dir / node))    # what the agent was never told is stored
    nats_cluster.start("n2")
    nats_cluster.start("n3")
    ids = stream_ids(nats_cluster)
    highs = check_exactly_once(ids, contiguous=False)   # publishes retried after the outage may land out of order
    (boot, high), = [(b, h) for (n, b), h in highs.items() if n == node]
    made = {seq for b, seq in left if b == boot}
    assert made, "the agent had batches in its spool"
    # Everything the agent made up to its last seq is stored, or still in its spool (not acked).
    last = max(max(made), high)
    missing = [s for s in range(1, last + 1) if f"{node}:{boot}:{s}" not in ids and s not in made]
    assert not missing, f"acknowledged but not stored: {missing[:10]}"
    # A new agent process resends the old boot's batches from the spool: all of them, once.
    _agent(procs, tmp_path, addr, node, "agent-2")
    wait_until(lambda: _highs(nats_cluster, node).get(boot, 0) >= last, 120, what="the spool resent")
    assert gw.p.poll() is None


def test_cluster_mode_commands_say_what_is_wrong(tmp_path):
    import subprocess
    col = str(BIN / "xpusense-collector")
    out = subprocess.run([col, "worker"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--nats" in out.stderr
    out = subprocess.run([col, "serve", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "data_dir" in out.stderr
    bad = tmp_path / "c.toml"
    bad.write_text("[nats]\nurls = [\"nats://127.0.0.1:1\"]\npartitions = 2\nstreams = 4\n")
    out = subprocess.run([col, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nats.streams" in out.stderr
    out = subprocess.run([col, "worker", "--nats", f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "cannot reach the NATS cluster" in out.stderr


def test_connection_tells_a_lost_server_from_a_close(nats_cluster, tmp_path, caplog):  # noqa: F811
    """engine.connect's callbacks: the server it is connected to SIGKILLed -> a warning that it
    reconnects, on_state False then True (another server); a close() -> on_state False and an info
    line, not the warning (nats-py calls the disconnected callback on close() too)."""
    import asyncio
    import logging

    from xpusense.collector.cluster.cli import load_config
    from xpusense.collector.cluster.engine import connect

    cfg = load_config(str(cluster_config(tmp_path, nats_cluster)), {}, env={})
    states: list[bool] = []
    lost = "nats: disconnected from the cluster; reconnecting"

    async def until(cond, what: str, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, f"{what}: states {states}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        nc = await connect(cfg.nats, "test-connection", on_state=states.append, role="gateway")
        try:
            port = nc.connected_url.port
            name = next(s.name for s in nats_cluster.servers if s.port == port)
            await asyncio.get_running_loop().run_in_executor(None, nats_cluster.kill, name)
            await until(lambda: states == [False, True], "reconnected to another server")
            assert nc.connected_url.port != port
        finally:
            await nc.close()

    with caplog.at_level(logging.INFO, logger="xpusense.collector.cluster"):
        run(scenario(), timeout_s=120)
    said = [r.getMessage() for r in caplog.records if r.name == "xpusense.collector.cluster"]
    assert states == [False, True, False]
    assert said.count(lost) == 1, said
    assert said[-1] == "nats: connection closed", said


def test_disconnect_closes_a_connection_the_cluster_has_gone_from(nats_cluster, tmp_path):  # noqa: F811
    """engine.disconnect, what every cluster-mode process does when it stops: a connected client is
    drained and closed; one reconnecting (every server gone) is closed too, where nats-py's drain()
    refuses it (ConnectionReconnectingError) and left it open to the loop's teardown."""
    import asyncio

    import nats.errors

    from xpusense.collector.cluster.cli import load_config
    from xpusense.collector.cluster.engine import connect, disconnect

    cfg = load_config(str(cluster_config(tmp_path, nats_cluster)), {}, env={})

    async def scenario() -> tuple[bool, bool, str]:
        healthy = await connect(cfg.nats, "test-healthy", role="gateway")
        await disconnect(healthy)
        lost = await connect(cfg.nats, "test-lost", role="gateway")
        try:
            loop = asyncio.get_running_loop()
            for s in nats_cluster.servers:
                await loop.run_in_executor(None, nats_cluster.kill, s.name)
            deadline = loop.time() + 60
            while not lost.is_reconnecting:
                assert loop.time() < deadline, "the client never noticed every server gone"
                await asyncio.sleep(0.05)
            try:
                await lost.drain()
                refused = "drained"
            except nats.errors.ConnectionReconnectingError:
                refused = "refused"
            await disconnect(lost)
            return healthy.is_closed, lost.is_closed, refused
        finally:
            if not lost.is_closed:
                await lost.close()

    healthy_closed, lost_closed, drain = run(scenario(), timeout_s=120)
    assert healthy_closed
    assert drain == "refused"      # what the processes called before: the connection stayed open
    assert lost_closed


def test_pipelined_publish_acks_duplicates_times_out_and_gives_up(nats_cluster, tmp_path):  # noqa: F811
    """The gateway's pipelined first publish (one ack inbox, one timeout sweeper), against the real
    cluster: a new msg id is stored, the same id again is a duplicate; a publish nobody answers
    is failed by the sweeper (counted), sent again, and given up as PublishFailed; a subject no
    stream holds is given up the same way."""
    from xpusense.collector.cluster.cli import load_config
    from xpusense.collector.cluster.engine import connect, ensure
    from xpusense.collector.cluster.gateway import Gateway, PublishFailed
    from xpusense.collector.cluster.subjects import MSG_ID, node_subject, partition

    cfg = load_config(str(cluster_config(tmp_path, nats_cluster)), {}, env={})
    n = cfg.nats
    n.publish_timeout_s, n.publish_give_up_s = 0.5, 1.5
    silent, nostream = f"$KV.{n.fleet_bucket}.x", f"{n.prefix}.r1.nopartition.x"

    async def scenario():
        nc = await connect(n, "test-gateway", role="gateway")
        try:
            gw = Gateway(nc, nc.jetstream(timeout=10), await ensure(nc.jetstream(timeout=10), n), n)
            await gw.start()
            subject = node_subject(n.prefix, "r1", partition("pipe-1", n.partitions), "pipe-1")
            headers = {MSG_ID: "pipe-1:b:1"}
            outcomes = []
            for _ in range(2):
                since = time.monotonic()
                fut = await gw.publish_nowait(subject, b"batch", headers)
                outcomes.append(await gw.settle(fut, subject, b"batch", headers, since))
            assert gw.acks_waiting == 0
            async def outcome(subject: str, msg_id: str) -> str:
                since = time.monotonic()
                fut = await gw.publish_nowait(subject, b"x", {MSG_ID: msg_id})
                try:
                    await gw.settle(fut, subject, b"x", {MSG_ID: msg_id}, since)
                    return "acknowledged"
                except PublishFailed as e:
                    return str(e)
            # No answer at all: a subject the servers drop (not this identity's to publish to).
            silent_outcome = await outcome(silent, "s:1")
            nostream_outcome = await outcome(nostream, "n:1")   # no stream holds it: "no responders"
            await gw.close()
            return outcomes, gw.timeouts, gw.retries, silent_outcome, nostream_outcome, gw.acks_waiting
        finally:
            await nc.close()

    outcomes, timeouts, retries, silent_outcome, nostream_outcome, waiting = run(scenario())
    assert outcomes == [False, True]                       # stored, then a duplicate by msg id
    assert timeouts == 1 and retries >= 2                   # the sweeper failed the first try; sent again
    assert f"no JetStream ack for {silent}" in silent_outcome, silent_outcome
    assert f"no JetStream ack for {nostream}" in nostream_outcome, nostream_outcome
    assert waiting == 0


def test_a_series_table_put_rides_out_the_series_buckets_leader_election(nats_cluster, tmp_path):  # noqa: F811
    """A gateway writes a stream's series tables with Gateway.put, retried as its publishes are: a
    put made just after the series bucket's stream leader is killed is stored once a new leader is
    elected, instead of ending the agent's stream (each try waits at most 1 s here)."""
    from xpusense.collector.cluster.cli import load_config
    from xpusense.collector.cluster.engine import connect, ensure
    from xpusense.collector.cluster.gateway import Gateway

    cfg = load_config(str(cluster_config(tmp_path, nats_cluster)), {}, env={})
    n = cfg.nats
    n.publish_give_up_s = 90.0
    stream = f"KV_{n.series_bucket}"

    async def scenario():
        nc = await connect(n, "test-gateway", role="gateway")
        try:
            js = nc.jetstream(timeout=1)
            buckets = await ensure(nc.jetstream(timeout=10), n)
            series = await js.key_value(n.series_bucket)
            gw = Gateway(nc, js, buckets, n)
            await gw.put(series, "node.boot.1", b"first")
            leader = nats_cluster.stream_leader(stream)
            assert leader, "the series bucket's stream has a leader"
            nats_cluster.kill(leader)
            try:
                await gw.put(series, "node.boot.2", b"second")
                stored = (await series.get("node.boot.2")).value
                new_leader = nats_cluster.stream_leader(stream)
            finally:
                nats_cluster.start(leader)
            return leader, new_leader, stored
        finally:
            await nc.close()

    leader, new_leader, stored = run(scenario())
    assert stored == b"second"
    assert new_leader and new_leader != leader


def test_marks_first_writes_spread_over_flush_s_then_every_flush_s(nats_cluster, tmp_path):  # noqa: F811
    """Boots that all said Hello together (a fleet starting, a gateway's agents moving over) have
    their first mark write set at random points of flush_s, not in one burst; every mark reaches the
    bucket as the highest acknowledged sequence; a later raise is set flush_s after its write."""
    import asyncio
    import random

    from xpusense.collector.cluster.cli import load_config
    from xpusense.collector.cluster.engine import connect, ensure
    from xpusense.collector.cluster.seq_marks import Marks
    from xpusense.collector.cluster.subjects import mark_key

    cfg = load_config(str(cluster_config(tmp_path, nats_cluster)), {}, env={})
    n = cfg.nats
    flush_s, boots = 2.0, 40

    async def scenario():
        loop = asyncio.get_running_loop()
        nc = await connect(n, "test-marks", role="gateway")
        try:
            buckets = await ensure(nc.jetstream(timeout=10), n)
            marks = Marks(buckets.marks, flush_s=flush_s, rng=random.Random(5))
            t0 = loop.time()
            for i in range(boots):
                marks.raised(f"spread-{i}", "b1", 7)
            due = [marks.marks[(f"spread-{i}", "b1")].due - t0 for i in range(boots)]
            deadline = loop.time() + flush_s + 60
            while (any(m.written < 7 for m in marks.marks.values()) or any(m.task for m in marks.marks.values())) \
                    and loop.time() < deadline:
                await asyncio.sleep(0.02)
            values = [int((await buckets.marks.get(mark_key(f"spread-{i}", "b1"))).value) for i in range(boots)]
            later = marks.marks[("spread-0", "b1")]
            t1 = loop.time()
            marks.raised("spread-0", "b1", 9)
            later_due = later.due - t1
            while later.written < 9 and loop.time() < deadline:
                await asyncio.sleep(0.02)
            await marks.flush_all()
            return due, values, later.written, later_due
        finally:
            await nc.close()

    due, values, later_written, later_due = run(scenario())
    assert values == [7] * boots and later_written == 9
    # Spread: set for every quarter of flush_s (a burst would have them all at flush_s).
    assert all(0 <= d < flush_s for d in due) and {int(d / (flush_s / 4)) for d in due} == {0, 1, 2, 3}, due
    assert flush_s <= later_due < flush_s + 1   # after the first write: flush_s from the raise
