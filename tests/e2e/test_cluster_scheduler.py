"""Cluster mode, scheduler replicas: `xpusense-collector scheduler` lists then
watches the `fleet` bucket into the scheduler core's index and answers Place from it; any number
run, each answers alike, and a node's XID event reaches every replica's index."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.request

from cluster_support import SimAgent, cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, free_port, nodes_json, until, wait_until

FLEET = {"bj-1": {"region": "cn-beijing", "zone": "a", "price": "4.0"},
         "bj-2": {"region": "cn-beijing", "zone": "b", "price": "2.0"},
         "sh-1": {"region": "cn-shanghai", "zone": "c", "price": "3.0"}}


def place(addr, *args):
    out = subprocess.run([str(BIN / "xpusense-collector"), "place", "--collector", addr, "--format", "json",
                          "--accelerator", "gpu", "--memory", "40GB", "--count", "2", "--limit", "10", *args],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def start_scheduler(procs, cfg, name):
    addr = f"127.0.0.1:{free_port()}"
    p = procs(module_cmd("scheduler", "--config", str(cfg), "--listen", addr), name)
    wait_until(lambda: "scheduler listening" in p.output() or p.p.poll() is not None, 60, what=name)
    assert p.p.poll() is None, p.output()
    return p, addr


def test_scheduler_replicas_answer_place_from_the_fleet_bucket(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    metrics_port = free_port()                                       # scheduler 1 also serves Prometheus
    cfg1 = cluster_config(tmp_path, nats_cluster, name="scheduler-1.toml", extra=f"""[export.prometheus]
enabled = true
listen = "127.0.0.1:{metrics_port}"
compat_names = true
""")
    s1, a1 = start_scheduler(procs, cfg1, "scheduler-1")            # started before any node: the watch fills it
    agents = {n: SimAgent(gw, n, labels) for n, labels in FLEET.items()}
    readings = {n: {} for n in FLEET}            # what each node reports, as live agents would every 0.5 s
    stop = threading.Event()

    def report():
        while not stop.wait(0.5):
            for n, a in agents.items():
                a.send(**readings[n])
    threading.Thread(target=report, daemon=True).start()
    s2, a2 = start_scheduler(procs, cfg, "scheduler-2")            # started after: the list fills it
    for addr in (a1, a2):
        r = wait_until(lambda addr=addr: (r := place(addr)) and r.get("nodes_feasible") == 3 and r, 60,
                       what=f"3 feasible nodes at {addr}")
        assert r["nodes_total"] == 3
    ranks = lambda addr: [(c["node_id"], round(c["score"], 6)) for c in place(addr)["candidates"]]  # noqa: E731
    wait_until(lambda: ranks(a1) == ranks(a2), 30, what=f"both replicas ranking alike: {ranks(a1)} / {ranks(a2)}")
    ranked = [c["node_id"] for c in place(a1, "--region", "cn-beijing")["candidates"]]
    assert ranked[0] == "bj-2" and set(ranked) == {"bj-1", "bj-2"}   # cheaper per TFLOPS first; region filter
    # An XID on bj-2's gpu0..gpu6 leaves it one healthy device: it cannot take 2, in every replica.
    from xpusense.v1 import telemetry_pb2 as pb
    xids = [pb.Event(id=f"x{i}", type="xid", severity="critical", device=f"gpu{i}", message="XID 79",
                     attributes={"xid": "79"}, time_unix_nano=time.time_ns()) for i in range(7)]
    agents["bj-2"].send(events=xids)
    for addr in (a1, a2):
        wait_until(lambda addr=addr: "bj-2" not in [c["node_id"] for c in place(addr)["candidates"]], 30,
                   what=f"the XID in {addr}'s index")
    # Fresh readings move the ranking: bj-1 busy and full leaves sh-1 on top.
    readings["bj-1"] = {"util": 0.95, "used": 79 * 2**30}
    wait_until(lambda: [c["node_id"] for c in place(a2)["candidates"]] == ["sh-1"], 30, what="bj-1 full")
    # nodes through a scheduler replica: the same fleet; and Prometheus scrapes the whole fleet there
    assert {n["node_id"] for n in nodes_json(a1)["nodes"]} == set(FLEET)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for node in FLEET:
        assert f'hw_gpu_utilization_ratio{{device="gpu0",host_name="{node}",node="{node}",vendor="nvidia"}}' in text
        assert re.search(rf'DCGM_FI_DEV_FB_USED\{{[^}}]*Hostname="{node}"', text)
    # one replica gone, the other answers on
    s1.kill(signal.SIGKILL)
    assert place(a2)["nodes_total"] == 3
    # a gateway does not answer Place by default, and says where to ask
    out = subprocess.run([str(BIN / "xpusense-collector"), "place", "--collector", gw], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 1 and "scheduler replicas" in out.stderr
    stop.set()
    for a in agents.values():
        a.close()
    assert s2.p.poll() is None


class _FlakyBucket:
    """A real KV bucket whose first watch cannot start (as when the consumer info times out on a busy
    server) and whose second watch the test ends from outside (as a lost subscription does)."""

    def __init__(self, kv):
        self.kv, self.watches, self.live = kv, 0, None

    async def watchall(self, **kw):
        self.watches += 1
        if self.watches == 1:
            import nats.errors
            raise nats.errors.TimeoutError
        self.live = await self.kv.watchall(**kw)
        return self.live


def test_fleet_index_lists_and_watches_again_when_its_watch_fails_or_ends(nats_cluster):  # noqa: F811
    """The replica's index keeps following the bucket: a watch that cannot start, then one that
    ends, are each followed by a new list and watch, and a summary written after each is seen."""
    import asyncio

    import nats
    from cluster_support import connect_as, run

    from xpusense.collector.cluster import scheduler as cluster_scheduler
    from xpusense.collector.cluster.engine import ensure
    from xpusense.collector.cluster.scheduler import FleetIndex
    from xpusense.collector.cluster.summary import NodeLatest
    from xpusense.v1 import telemetry_pb2 as pb

    def summary(nid: str) -> bytes:
        n = NodeLatest(nid, 0)
        n.hello(pb.Hello(node_id=nid, boot_id="b", inventory=pb.Inventory(hostname=nid)), "gw", "", 1)
        return n.encode("w", 1)

    async def scenario():
        # Each side with its own identity: a gateway's creates the buckets, a worker's writes
        # summaries, the scheduler replica's index reads them.
        gw, nw, nc = [await connect_as(nats_cluster, role) for role in ("gateway", "worker", "scheduler")]
        await ensure(gw.jetstream(timeout=10), nats_cluster.ncfg)
        await gw.close()
        kv = await nw.jetstream(timeout=10).key_value("fleet")
        js = nc.jetstream(timeout=10)
        for _ in range(600):   # a new R3 bucket answers once its stream has elected a leader
            try:
                await kv.put("n1", summary("n1"))
                break
            except nats.js.errors.NoStreamResponseError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the new fleet bucket's stream never elected a leader")
        cluster_scheduler.WATCH_BACKOFF_S = (0.05, 0.2)
        idx, bucket = FleetIndex(), _FlakyBucket(await js.key_value("fleet"))
        task = asyncio.get_running_loop().create_task(idx.follow(js, bucket, "fleet"))
        try:
            await until(lambda: bucket.live is not None, "a second watch after the first could not start")
            assert "n1" in idx.nodes and idx.watch_restarts == 1
            await kv.put("n2", summary("n2"))
            await until(lambda: "n2" in idx.nodes, "n2 through the second watch")
            first_live = bucket.live
            await first_live.stop()
            await until(lambda: bucket.watches == 3, "a third watch after the second ended")
            await kv.put("n3", summary("n3"))
            await until(lambda: "n3" in idx.nodes, "n3 through the third watch")
            return idx.watch_restarts, sorted(idx.nodes)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()
            await nw.close()

    saved = cluster_scheduler.WATCH_BACKOFF_S
    try:
        restarts, nodes = run(scenario(), 120)
    finally:
        cluster_scheduler.WATCH_BACKOFF_S = saved
    assert restarts == 2 and nodes == ["n1", "n2", "n3"]
