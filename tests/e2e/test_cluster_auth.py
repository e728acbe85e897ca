"""Cluster mode's NATS trusts no one by default: the loopback cluster (as deployed) lets in only a
client with a role's certificate, and each role only does its part (collector/cluster/nats_auth.py).
An anonymous client, one without a certificate or with another CA's is refused; a gateway's identity
cannot write the `fleet` or `leases` bucket, a scheduler's or a worker's cannot publish a batch;
meanwhile the real node goes on being stored and placed."""

from __future__ import annotations

import asyncio
import ssl

import nats
import nats.errors
import nats.js.errors
import pytest
from cluster_support import SimAgent, cluster_config, connect_as, module_cmd, nats_cluster, run, start_gateway  # noqa: F401
from helpers import nodes_json, wait_until
from test_cluster_scheduler import place, start_scheduler

from xpusense.collector.certs import make_certs
from xpusense.collector.cluster.engine import list_bucket
from xpusense.collector.cluster.subjects import KIND, MSG_ID, node_subject, partition, stream_name
from xpusense.v1 import telemetry_pb2 as pb


async def _refused(**opts) -> str:
    """How the cluster refused a connection (an AssertionError when it let it in)."""
    try:
        nc = await asyncio.wait_for(nats.connect(**opts, connect_timeout=2, allow_reconnect=False,
                                                 max_reconnect_attempts=0), 20)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    await nc.close()
    raise AssertionError(f"connected with {sorted(opts)}")


def test_only_a_role_certificate_gets_in(nats_cluster, tmp_path):  # noqa: F811
    s = nats_cluster.servers[0]
    other = make_certs(str(tmp_path / "agents-ca"), ["gpu-1"])   # the agents' CA: a valid certificate, not NATS's
    foreign = nats_cluster.client_tls(None)
    foreign.load_cert_chain(other["nodes"]["gpu-1"]["cert"], other["nodes"]["gpu-1"]["key"])

    async def scenario():
        return {
            "plain": await _refused(servers=[f"nats://127.0.0.1:{s.port}"]),
            "no certificate": await _refused(servers=[s.url], tls=nats_cluster.client_tls(None)),
            "another CA": await _refused(servers=[s.url], tls=foreign),
            "untrusted server": await _refused(servers=[s.url], tls=ssl.create_default_context()),
        }
    refused = run(scenario(), 120)
    assert len(refused) == 4, refused

    async def role():   # and the roles do get in
        for r in ("gateway", "worker", "scheduler", "exporter"):
            nc = await connect_as(nats_cluster, r)
            assert nc.is_connected
            await nc.close()
    run(role())


async def _denied(nc, errors: list, subject: str, write) -> None:
    """`write` fails (no ack: the servers dropped it) and the servers said why."""
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError)):
        await write()
    for _ in range(100):
        if any(f'permissions violation for publish to "{subject.lower()}"' in str(e).lower() for e in errors):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no permissions violation for {subject}: {errors}")


def test_each_identity_only_does_its_part_and_the_fleet_goes_on(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    _, sched = start_scheduler(procs, cfg, "scheduler")
    real = SimAgent(gw, "real-1", {"region": "r1"})
    sent = [real.send()]
    wait_until(lambda: sent.append(real.send()) or [n["node_id"] for n in place(sched)["candidates"]] == ["real-1"],
               90, interval_s=0.5, what="the real node placed")
    n = nats_cluster.ncfg
    forged = "forged-1"
    subject = node_subject(n.prefix, "r1", partition(forged, n.partitions), forged)
    hello = pb.AgentMessage(hello=pb.Hello(node_id=forged, boot_id="b", inventory=pb.Inventory(hostname=forged)))
    batch = pb.Batch(node_id="real-1", boot_id=real.boot, seq=2**64 - 1)

    async def attacks():
        out = {}
        for role in ("gateway", "scheduler", "worker", "exporter"):
            errors: list = []

            async def on_error(e, errors=errors):
                errors.append(e)
            nc = await connect_as(nats_cluster, role, error_cb=on_error)
            js = nc.jetstream(timeout=1)
            try:
                fleet, leases = await js.key_value(n.fleet_bucket), await js.key_value(n.leases_bucket)
                if role != "worker":   # the fleet bucket is the workers' alone
                    await _denied(nc, errors, f"$KV.{n.fleet_bucket}.p0.{forged}",
                                  lambda fleet=fleet: fleet.put(f"p0.{forged}", b"a summary from the future"))
                    await _denied(nc, errors, f"$KV.{n.leases_bucket}.p.0",
                                  lambda leases=leases: leases.put("p.0", b"mine"))
                if role != "gateway":  # batches are the gateways' alone
                    await _denied(nc, errors, subject, lambda js=js: js.publish(
                        subject, hello.SerializeToString(), headers={KIND: "hello"}))
                    real_subject = node_subject(n.prefix, "r1", partition("real-1", n.partitions), "real-1")
                    await _denied(nc, errors, real_subject, lambda js=js, s=real_subject: js.publish(
                        s, pb.AgentMessage(batch=batch).SerializeToString(),
                        headers={MSG_ID: f"real-1:{real.boot}:{2**64 - 1}"}))
                if role != "gateway":  # and the marks the gateways'
                    await _denied(nc, errors, f"$KV.{n.marks_bucket}.x", lambda js=js: js.publish(
                        f"$KV.{n.marks_bucket}.x", str(2**64 - 1).encode()))
                out[role] = len(errors)
            finally:
                await nc.close()
        # what the buckets and streams hold: nothing of it (read as a worker, who may)
        nc = await connect_as(nats_cluster, "worker")
        try:
            js = nc.jetstream(timeout=10)
            keys = [k for k, _, _ in await list_bucket(js, n.fleet_bucket)]
            subjects: dict = {}
            for i in range(n.streams):
                info = await js.stream_info(stream_name(n.prefix, i), subjects_filter=">")
                subjects.update(info.state.subjects or {})
        finally:
            await nc.close()
        return out, keys, subjects

    counts, keys, subjects = run(attacks(), 240)
    assert all(counts.values()), counts
    assert keys == ["p" + str(partition("real-1", n.partitions)) + ".real-1"], keys
    assert not [s for s in subjects if forged in s], subjects
    # the real node goes on: stored and placed, alone
    stored = nodes_json(gw)["nodes"][0]["batches_stored"]
    wait_until(lambda: sent.append(real.send()) or nodes_json(gw)["nodes"][0]["batches_stored"] >= stored + 5, 60,
               interval_s=0.3, what="the real node's batches stored")
    assert [x["node_id"] for x in nodes_json(gw)["nodes"]] == ["real-1"]
    assert [c["node_id"] for c in place(sched)["candidates"]] == ["real-1"]
    real.close()
