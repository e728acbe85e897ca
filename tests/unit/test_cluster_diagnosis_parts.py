"""Cluster mode's open diagnoses without a NATS cluster: a worker (its real message handler) keeps a
node's open diagnoses with collector/diagnoses.py, bounded by [state] max_open_diagnoses_per_node and
counted; the summary carries them over a takeover; the readers (FleetIndex, the Query API's
list_nodes, the scheduler core, the Prometheus collector) show and use them."""

from __future__ import annotations

import time
from types import SimpleNamespace

from xpusense.collector.cluster.query import list_nodes
from xpusense.collector.cluster.scheduler import FleetIndex
from xpusense.collector.cluster.subjects import KIND, MSG_ID, RECEIVED, msg_id, node_subject
from xpusense.collector.cluster.summary import NodeLatest, decode
from xpusense.collector.cluster.worker import Worker
from xpusense.collector.config import load_collector
from xpusense.collector.inventory_book import InventoryBook
from xpusense.collector.prometheus import FleetCollector
from xpusense.collector.scheduler.core import Scheduler
from xpusense.collector.scheduler.inventory import parse_memory
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb

NODE = "cd-1"
CFG = load_collector(None, env={})


def _msg(data: bytes, kind: str | None = None, boot: str = "b1"):
    """A message as a gateway publishes it (its receive time; a batch's msg id)."""
    if kind:
        headers = {KIND: kind, "Xps-Session": f"s-{boot}", RECEIVED: str(time.time_ns())}
    else:
        b = pb.Batch.FromString(data)
        headers = {MSG_ID: msg_id(b.node_id, b.boot_id, b.seq), RECEIVED: str(time.time_ns())}
    return SimpleNamespace(subject=node_subject("xpusense", "r1", 0, NODE), reply="", headers=headers, data=data)


def _hello(boot: str) -> bytes:
    inv = pb.Inventory(hostname=NODE, labels={"region": "r1", "zone": "z1", "price": "2.0"})
    for i in range(4):
        inv.resources.add(type="GPU", vendor="nvidia", model="A100-SXM4-80GB", id=f"gpu{i}",
                          attributes={"memory": "80GB"})
    return pb.Hello(node_id=NODE, boot_id=boot, inventory=inv).SerializeToString()


def _batch(seq: int, events=(), boot: str = "b1") -> bytes:
    t = time.time_ns()
    b = pb.Batch(node_id=NODE, boot_id=boot, seq=seq, events=list(events))
    for i in range(4):
        lab = {"device": f"gpu{i}", "vendor": "nvidia"}
        for name, v in (("hw.gpu.utilization", 0.1), ("hw.gpu.memory.usage", 2 * 2**30),
                        ("hw.gpu.memory.limit", 80 * 2**30)):
            b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels=lab, value=v, time_unix_nano=t)
    return b.SerializeToString()


def _diag(did: str, state: str, device: str = "gpu1", rule: str = "pcie_contention") -> pb.Event:
    return pb.Event(id=f"{did}-{state}", type="diagnosis", severity="warning", device=device, message="m",
                    time_unix_nano=time.time_ns(), attributes={
                        "diagnosis.id": did, "diagnosis.state": state, "diagnosis.rule": rule,
                        "diagnosis.cause": f"cause of {did}",
                        "diagnosis.opened_unix_nano": str(time.time_ns() - 20 * 10**9)})


def _worker(max_open: int = 64) -> Worker:
    return Worker(None, None, SimpleNamespace(), "w1", max_open_diagnoses_per_node=max_open)


def _penalties(index: FleetIndex, core: Scheduler) -> list:
    reply = core.place(spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=parse_memory("10GB"), count=4))
    (cand,) = [c for c in reply.candidates if c.node_id == NODE]
    return [(p.reason, p.device, p.detail) for p in cand.penalties]


def _prom(index: FleetIndex) -> dict:
    book = InventoryBook().watch(index)
    for n in index.nodes.values():
        book._on_change(n, None)
    out = {}
    for fam in FleetCollector(index, book).collect():
        if fam.name.startswith("xpusense_diagnoses"):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_worker_keeps_open_diagnoses_into_the_summary_and_the_readers_follow():
    w = _worker()
    w._handle(0, _msg(_hello("b1"), "hello"))
    w._handle(0, _msg(_batch(1)))
    index = FleetIndex()
    core = Scheduler(index, CFG.scheduler, CFG.stale_s, refresh_ms=0)
    index.apply(w.nodes[NODE].encode("w1", 1), revision=1)
    assert _penalties(index, core) == []
    w._handle(0, _msg(_batch(2, [_diag("d1", "open"), _diag("d0", "open", device="", rule="network_stack")])))
    d = decode(w.nodes[NODE].encode("w1", 2))
    assert [row[5]["diagnosis.id"] for row in d["diagnoses"]] == ["d1", "d0"] and d["diagnoses_boot"] == "b1"
    assert d["diagnoses_opened"] == {"pcie_contention": 1, "network_stack": 1}
    index.apply(w.nodes[NODE].encode("w1", 2), revision=2)

    (nv,) = list_nodes(index.nodes, pb.ListNodesRequest()).nodes
    assert [(e.device, e.attributes["diagnosis.id"], e.attributes["diagnosis.cause"]) for e in nv.diagnoses] == [
        ("gpu1", "d1", "cause of d1"), ("", "d0", "cause of d0")]
    ((reason, device, detail),) = _penalties(index, core)   # the node-wide one penalises no device
    assert (reason, device) == ("diagnosis", "gpu1")
    assert detail.startswith("open diagnosis pcie_contention (opened 2") and detail.endswith("cause of d1"), detail
    prom = _prom(index)
    assert prom[("xpusense_diagnoses_open", (("device", "gpu1"), ("node", NODE), ("rule", "pcie_contention")))] == 1
    assert prom[("xpusense_diagnoses_opened_total", (("rule", "network_stack"),))] == 1

    # a redelivered batch (the same seq) opens nothing again; the close takes it away everywhere
    w._handle(0, _msg(_batch(2, [_diag("d1", "open"), _diag("d0", "open", device="", rule="network_stack")])))
    w._handle(0, _msg(_batch(3, [_diag("d1", "closed")])))
    index.apply(w.nodes[NODE].encode("w1", 3), revision=3)
    (nv,) = list_nodes(index.nodes, pb.ListNodesRequest()).nodes
    assert [e.attributes["diagnosis.id"] for e in nv.diagnoses] == ["d0"]
    assert _penalties(index, core) == []
    prom = _prom(index)
    assert ("xpusense_diagnoses_open", (("device", "gpu1"), ("node", NODE), ("rule", "pcie_contention"))) not in prom
    assert prom[("xpusense_diagnoses_opened_total", (("rule", "pcie_contention"),))] == 1


def test_bound_new_boot_and_takeover():
    w = _worker(max_open=2)
    w._handle(0, _msg(_hello("b1"), "hello"))
    w._handle(0, _msg(_batch(1, [_diag(f"d{i}", "open", device=f"gpu{i}") for i in range(3)])))
    assert list(w.nodes[NODE].diagnoses) == ["d1", "d2"]
    # a new owner restores the node from its summary: the diagnoses and counts too
    d = decode(w.nodes[NODE].encode("w1", 1))
    w2 = _worker(max_open=2)
    w2.nodes[NODE] = NodeLatest.restore(d, 0)
    assert list(w2.nodes[NODE].diagnoses) == ["d1", "d2"]
    w2._handle(0, _msg(_batch(2, [_diag("d3", "open", device="gpu3")])))
    index = FleetIndex()
    index.apply(w2.nodes[NODE].encode("w2", 2), revision=2)
    reply = list_nodes(index.nodes, pb.ListNodesRequest())
    assert [e.attributes["diagnosis.id"] for e in reply.nodes[0].diagnoses] == ["d2", "d3"]
    assert reply.counters["state.max_open_diagnoses_per_node"] == 2
    assert _prom(index)[("xpusense_diagnoses_opened_total", (("rule", "pcie_contention"),))] == 4
    # the agent starts again: its last boot's diagnoses end, counted; a resend of the old boot opens nothing
    w2._handle(0, _msg(_hello("b2"), "hello", boot="b2"))
    w2._handle(0, _msg(_batch(5, [_diag("d9", "open")], boot="b1")))
    assert list(w2.nodes[NODE].diagnoses) == []
    index.apply(w2.nodes[NODE].encode("w2", 3), revision=3)
    reply = list_nodes(index.nodes, pb.ListNodesRequest())
    assert list(reply.nodes[0].diagnoses) == [] and reply.counters["diagnoses.closed_by_new_boot"] == 2
