"""`xpusense-collector place` against a real collector process fed by simulated agents over the
real Ingest stream: the answer as JSON and as a table, memory fit, data sovereignty, staleness,
XIDs, and the command's errors."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time

import grpc
import pytest
from helpers import BIN, Proc, free_port, nodes_json, wait_until

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

GiB = 2**30
STALE_S = 1.5
KINDS = {  # type, vendor, model, memory attribute, HBM bytes, interconnect
    "a100": ("GPU", "nvidia", "A100-SXM4-80GB", "80GB", 80 * GiB, "NVLink"),
    "910b": ("NPU", "huawei", "Ascend-910B", "64GB", 64 * GiB, "HCCS"),
    "910b4": ("NPU", "huawei", "Ascend-910B4", "32GB", 32 * GiB, "HCCS"),
}
FLEET = {  # node -> kind, labels
    "bj-a100-1": ("a100", {"region": "cn-beijing", "zone": "bj-a", "price": "4.0"}),
    "bj-a100-xid": ("a100", {"region": "cn-beijing", "zone": "bj-b", "price": "4.0"}),
    "bj-910b-1": ("910b", {"region": "cn-beijing", "zone": "bj-a", "price": "2.0"}),
    "bj-910b4-1": ("910b4", {"region": "cn-beijing", "zone": "bj-b", "price": "1.0"}),
    "sh-a100-1": ("a100", {"region": "cn-shanghai", "zone": "sh-a", "price": "3.0"}),
    "sh-910b4-1": ("910b4", {"region": "cn-shanghai", "zone": "sh-a", "price": "1.0"}),
    "gz-910b-quiet": ("910b", {"region": "cn-guangzhou", "zone": "gz-a", "price": "2.0"}),
}


def dev(kind: str, i: int) -> str:
    return f"gpu{i}" if KINDS[kind][0] == "GPU" else f"npu{i}-0"


class Agent:
    """A simulated agent on the real Ingest stream of the collector process."""

    def __init__(self, addr: str, node_id: str, kind: str, labels: dict):
        rtype, vendor, model, mem, self.hbm, link = KINDS[kind]
        self.node_id, self.kind, self.vendor = node_id, kind, vendor
        self.boot, self.seq, self.lock = f"boot-{node_id}", 0, threading.Lock()
        inv = pb.Inventory(hostname=node_id, labels=labels)
        for i in range(8):
            r = inv.resources.add(type=rtype, vendor=vendor, model=model, id=dev(kind, i), attributes={"memory": mem})
            r.interconnects.add(type=link)
        self.channel = grpc.insecure_channel(addr)
        self.out: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        self.out.put(pb.AgentMessage(hello=pb.Hello(node_id=node_id, boot_id=self.boot, inventory=inv)))
        self.calls = pb_grpc.IngestStub(self.channel).Stream(iter(self.out.get, None))
        assert next(self.calls).HasField("welcome")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for msg in self.calls:
                self.acks.put(msg.ack)
        except grpc.RpcError:
            pass

    def send(self, events=()):
        with self.lock:
            self.seq += 1
            t = time.time_ns()
            b = pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=self.seq, sent_unix_nano=t, events=list(events))
            for i in range(8):
                lab = {"device": dev(self.kind, i), "vendor": self.vendor}
                for name, value in (("hw.gpu.utilization", 0.1 * (i % 3)), ("hw.gpu.memory.usage", 2.0 * GiB),
                                    ("hw.gpu.memory.limit", float(self.hbm)),
                                    ("xpusense.accelerator.hbm.bandwidth.utilization", 0.2)):
                    b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels=lab, value=value, time_unix_nano=t)
            self.out.put(pb.AgentMessage(batch=b))
            ack = self.acks.get(timeout=10)
            assert ack.seq == self.seq

    def close(self):
        self.out.put(None)
        self.channel.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("place")
    cfg = d / "collector.toml"
    cfg.write_text(f"""
stale_s = {STALE_S}
[scheduler]
xid_window_s = 600
[scheduler.region_latency_ms]
"cn-shanghai/cn-beijing" = 30
[scheduler.region_transfer_cost]
"cn-shanghai/cn-beijing" = 0.02
[scheduler.peak_tflops]
"Ascend-910B" = 300
""")
    addr = f"127.0.0.1:{free_port()}"
    proc = Proc([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg), "--listen", addr], d / "collector.log")
    agents: dict[str, Agent] = {}
    stop = threading.Event()
    beating = set(FLEET)
    try:
        wait_until(lambda: nodes_json(addr) is not None, what="the collector to answer")
        for nid, (kind, labels) in FLEET.items():
            agents[nid] = Agent(addr, nid, kind, labels)
            agents[nid].send()

        def heartbeat():   # every node reports 4 times a second, as long as it is in `beating`
            while not stop.wait(0.25):
                for nid in list(beating):
                    try:
                        agents[nid].send()
                    except Exception:
                        pass
        t = threading.Thread(target=heartbeat, daemon=True)
        t.start()
        yield addr, agents, beating
        stop.set()
        t.join(5)
    finally:
        for a in agents.values():
            a.close()
        proc.kill(signal.SIGTERM)


def place(addr: str, *args: str, fmt: str = "json") -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "xpusense-collector"), "place", "--collector", addr, "--format", fmt, *args],
                          capture_output=True, text=True, timeout=30)


def place_json(addr: str, *args: str) -> dict:
    p = place(addr, *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_40gb_gets_a_910b_or_an_a100_never_a_910b4_as_json_and_table(fleet):
    addr, _, _ = fleet
    out = place_json(addr, "--accelerator", "any", "--memory", "40GB", "--count", "2", "--limit", "20")
    models = {c["node_id"]: c["model"] for c in out["candidates"]}
    assert models and set(models.values()) <= {"A100-SXM4-80GB", "Ascend-910B"}
    assert {"bj-a100-1", "bj-910b-1", "sh-a100-1"} <= set(models)
    excluded = {e["node_id"]: e for e in out["excluded"]}
    for nid in ("bj-910b4-1", "sh-910b4-1"):
        assert excluded[nid]["reason"] == "memory" and "have at least 30.0GiB" in excluded[nid]["detail"]   # 32 - 2 used
    assert out["excluded_counts"]["memory"] == 2
    best = out["candidates"][0]
    assert [d["dimension"] for d in best["dimensions"]] == ["compute", "data_affinity", "disaster_tolerance",
                                                            "compliance"]
    assert best["score"] == pytest.approx(sum(d["weighted"] for d in best["dimensions"]))
    assert len(best["devices"]) == 2 and out["weights"]["compute"] == pytest.approx(0.4)
    # The 910B (300 TFLOPS at 2.0) is the best value per price: it leads on compute.
    assert max(out["candidates"], key=lambda c: c["dimensions"][0]["score"])["node_id"] in ("bj-910b-1", "gz-910b-quiet")

    table = place(addr, "--accelerator", "any", "--memory", "40GB", "--count", "2", fmt="table")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "nodes can take it" in lines[0] and "weights compute=0.40" in lines[0]
    header = lines[2].split()
    assert header[:7] == ["#", "NODE", "SCORE", "COMPUTE", "DATA", "DR", "COMPLY"]
    first = lines[3].split()
    assert first[1] == best["node_id"] and float(first[2]) == pytest.approx(best["score"], abs=1e-3)
    assert any(line.startswith("left out:") and "memory 2" in line for line in lines)
    assert "910B4" not in "\n".join(lines[3:lines.index("") if "" in lines[3:] else None])


def test_data_sovereignty_keeps_every_candidate_in_the_region(fleet):
    addr, _, _ = fleet
    out = place_json(addr, "--memory", "16GB", "--residency", "region", "--data-region", "cn-beijing", "--limit", "20")
    assert out["candidates"] and all(c["labels"]["region"] == "cn-beijing" for c in out["candidates"])
    outside = [n for n, (_, labels) in FLEET.items() if labels["region"] != "cn-beijing"]
    counted = out["excluded_counts"].get("residency", 0) + out["excluded_counts"].get("stale", 0)
    assert counted == len(outside)
    assert {e["node_id"] for e in out["excluded"]} >= {"sh-a100-1", "sh-910b4-1"}
    # Only a preference without the constraint: Shanghai comes back, below Beijing on data affinity.
    out = place_json(addr, "--memory", "16GB", "--accelerator", "gpu", "--data-region", "cn-beijing")
    aff = {c["node_id"]: c["dimensions"][1]["score"] for c in out["candidates"]}
    assert aff["bj-a100-1"] == 1.0 and aff["sh-a100-1"] == pytest.approx(1 - 0.5 * 0.3 - 0.5 * 0.2)
    # --region lists the allowed regions.
    out = place_json(addr, "--memory", "16GB", "--region", "cn-shanghai")
    assert {c["node_id"] for c in out["candidates"]} == {"sh-a100-1", "sh-910b4-1"}


def test_a_gpu_with_a_fresh_xid_is_not_offered(fleet):
    addr, agents, _ = fleet
    agents["bj-a100-xid"].send(events=[pb.Event(id="x1", type="xid", severity="critical", device="gpu3",
                                                 message="XID 79: GPU has fallen off the bus",
                                                 attributes={"xid": "79"}, time_unix_nano=time.time_ns())])
    out = place_json(addr, "--accelerator", "gpu", "--memory", "40GB", "--count", "7", "--limit", "20")
    c = {c["node_id"]: c for c in out["candidates"]}["bj-a100-xid"]
    assert "gpu3" not in c["devices"] and len(c["devices"]) == 7
    assert c["excluded_devices"] == [{"device": "gpu3", "reason": "xid", "detail": c["excluded_devices"][0]["detail"]}]
    out = place_json(addr, "--accelerator", "gpu", "--memory", "40GB", "--count", "8", "--limit", "20")
    assert "bj-a100-xid" not in {c["node_id"] for c in out["candidates"]}
    e = {e["node_id"]: e for e in out["excluded"]}["bj-a100-xid"]
    assert e["reason"] == "xid" and e["devices"][0]["device"] == "gpu3" and "XID 79" in e["devices"][0]["detail"]


def test_a_node_that_stops_reporting_drops_out_once_stale(fleet):
    addr, _, beating = fleet
    ids = lambda out: {c["node_id"] for c in out["candidates"]}   # noqa: E731
    assert "gz-910b-quiet" in ids(place_json(addr, "--accelerator", "npu", "--memory", "40GB"))
    beating.discard("gz-910b-quiet")
    t0 = time.monotonic()

    def dropped():
        o = place_json(addr, "--accelerator", "npu", "--memory", "40GB")
        return o if "gz-910b-quiet" not in ids(o) else None
    out = wait_until(dropped, timeout_s=90, what="the silent node to go stale")
    assert time.monotonic() - t0 >= STALE_S * 0.5   # not at once: only after stale_s without telemetry
    e = {e["node_id"]: e for e in out["excluded"]}["gz-910b-quiet"]
    assert e["reason"] == "stale" and "stale after 1.5 s" in e["detail"]
    assert "bj-910b-1" in ids(out)   # the others, still reporting, are still offered


def test_place_errors_exit_2_or_1_with_a_message(fleet):
    addr, _, _ = fleet
    p = place(addr, "--weight", "compute=0.6")
    assert p.returncode == 2 and "'compute'" in p.stderr and "between 0.3 and 0.5" in p.stderr
    p = place(addr, "--weight", "compute=0.45")
    assert p.returncode == 2 and "add up to 1.05" in p.stderr
    p = place(addr, "--memory", "forty")
    assert p.returncode == 2 and "not a memory size" in p.stderr
    p = place(addr, "--residency", "region")
    assert p.returncode == 2 and "data region" in p.stderr
    p = place(f"127.0.0.1:{free_port()}", "--timeout-s", "1")
    assert p.returncode == 1 and "cannot place with the collector" in p.stderr
