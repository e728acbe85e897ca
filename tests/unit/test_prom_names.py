"""The Prometheus names of what nodes send (collector/prom_names.py): each rule that keeps a label
key, a metric name and a scrape's families valid, the counts of what was renamed or left out, and
the whole /metrics text of a fleet with one odd node, single-process and in cluster mode, read by
prometheus-client's strict OpenMetrics parser and by `promtool check metrics` where installed."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from xpusense.collector.cluster.scheduler import FleetIndex
from xpusense.collector.cluster.subjects import KIND, MSG_ID, RECEIVED, msg_id, node_subject
from xpusense.collector.cluster.worker import Worker
from xpusense.collector.inventory_book import InventoryBook
from xpusense.collector.prom_names import REASONS, Families, Tally, label_key, prom_labels, prom_name
from xpusense.collector.prometheus import FleetCollector
from xpusense.collector.state import FleetState
from xpusense.v1 import telemetry_pb2 as pb


def test_label_keys_follow_prometheus_rules():
    assert label_key("device") == ("device", None)
    assert label_key("k8s.pod.name") == ("k8s_pod_name", None)          # dots: the usual naming, not counted
    assert label_key("_private") == ("_private", None)
    assert label_key("a-b") == ("a_b", "label_renamed")
    assert label_key("clé") == ("cl_", "label_renamed")                  # one `_` per character
    assert label_key("a b/c") == ("a_b_c", "label_renamed")
    assert label_key("9lives") == ("key_9lives", "label_renamed")        # a leading digit
    assert label_key("__name__") == ("key__name__", "label_renamed")     # Prometheus' own prefix
    assert label_key("..x") == ("key__x", "label_renamed")               # `__` once the dots are underscores
    assert label_key("") == ("", "label_empty")                          # left out
    for own in ("node", "host_name", "le", "quantile", "job", "instance"):
        assert label_key(own) == (f"exported_{own}", "label_renamed")
    assert label_key("node", reserved=frozenset()) == ("node", None)


def test_labels_that_meet_are_one_with_their_values_joined_in_key_order():
    tally = Tally()
    got = prom_labels({"a.b": "2", "a-b": "1", "": "gone", "node": "n", "exported_node": "e", "ok": "v"}, tally=tally)
    assert got == {"a_b": "1;2", "exported_node": "e;n", "ok": "v"}
    assert prom_labels({"a-b": "1", "a.b": "2"}) == prom_labels({"a.b": "2", "a-b": "1"})   # whatever the order
    assert tally.counts == Counter(label_renamed=2, label_empty=1, label_merged=2)
    assert prom_labels({"ok": "v", "k8s.pod.name": "p"}) == {"ok": "v", "k8s_pod_name": "p"}


def test_metric_names():
    tally = Tally()
    assert prom_name("hw.gpu.memory.usage", "By", pb.GAUGE, tally) == "hw_gpu_memory_usage_bytes"
    assert prom_name("system.cpu.time", "s", pb.COUNTER, tally) == "system_cpu_time_seconds"
    assert not tally.counts                                              # the usual names count nothing
    assert prom_name("odd-metric.é", "1", pb.GAUGE, tally) == "odd_metric___ratio"
    assert prom_name("9x", "1", pb.GAUGE, tally) == "_9x_ratio"         # a leading digit
    assert prom_name("x", "m/s", pb.GAUGE, tally) == "x_m_s"            # a unit with no suffix of ours
    assert tally.counts == Counter(name_renamed=3)
    assert prom_name("", "By", pb.GAUGE, tally) == ""                   # nothing to call it: left out
    assert tally.counts["name_empty"] == 1
    assert prom_name("odd.requests.total", "{r}", pb.COUNTER) == "odd_requests"   # the sample adds `_total`
    assert prom_name("total", "{r}", pb.COUNTER) == "total"
    assert prom_name("odd.requests.total", "{r}", pb.GAUGE) == "odd_requests_total"


def test_one_type_per_name_and_no_series_twice():
    tally = Tally()
    f = Families(tally)
    f.reserve("xpusense_node_connected", "gauge")
    assert f.add("x", "counter", "h", {"a": "1"}, 1.0)
    assert not f.add("x_total", "gauge", "h", {"a": "1"}, 2.0)           # the counter writes x_total
    assert not f.add("x", "gauge", "h", {"a": "2"}, 2.0)                 # one name, one type
    assert f.add("x", "counter", "h", {"a": "2"}, 3.0)
    assert f.add("h", "histogram", "h", {}, 0.0, ([("1.0", 1.0), ("+Inf", 2.0)], 2.0, 1.5))
    assert not f.add("h_count", "gauge", "h", {}, 1.0)                   # the histogram's sample
    assert not f.add("h_bucket", "counter", "h", {}, 1.0)
    assert not f.add("xpusense_node_connected", "gauge", "h", {"node": "n"}, 1.0)   # the collector's own
    assert f.add("y", "gauge", "h", {"a": "1", "b": ""}, 1.0)
    assert not f.add("y", "gauge", "h", {"a": "1"}, 2.0)                 # an empty value is no label
    assert not f.add("x", "counter", "h", {"a": "1"}, 4.0)               # the same series again
    assert tally.counts == Counter(name_taken=5, series_duplicate=2)
    assert [(s.name, s.labels, s.value) for s in f.metrics["x"].samples] == [
        ("x_total", {"a": "1"}, 1.0), ("x_total", {"a": "2"}, 3.0)]     # first come, first written
    assert "x_total" not in f.metrics and "xpusense_node_connected" not in f.metrics
    with pytest.raises(ValueError, match="taken"):
        f.reserve("xpusense_node_connected", "counter")


def odd_batch(node: str, seq: int, t: int) -> pb.Batch:
    def s(name, value, kind=pb.GAUGE, unit="1", **labels):
        return pb.Sample(name=name, value=value, kind=kind, unit=unit, labels=labels, time_unix_nano=t)
    return pb.Batch(node_id=node, boot_id="b", seq=seq, samples=[
        s("hw.gpu.utilization", 0.5, device="gpu0", vendor="nvidia", **{"": "x", "__name__": "spoof"}),
        s("odd.chars", 3.0, **{"a-b": "1", "a.b": "2", "9lives": "4", "node": "spoof", "le": "0.5",
                               "quoted": 'a "b" \\ c\nd'}),
        s("odd.requests", 5.0, pb.COUNTER, "{request}"),
        s("odd.requests.total", 6.0, pb.GAUGE, "{request}"),
        s("DCGM_FI_DEV_GPU_UTIL", 7.0, pb.COUNTER, ""),                  # a dashboard name, another type
        s("xpusense.node.connected", 8.0, unit="{x}"),
        s("odd.dup", 9.0, **{"a.b": "1"}),
        s("odd.dup", 10.0, **{"a-b": "1"}),
        s("odd.latency", 1.0, pb.HISTOGRAM, "s", le="x"),
    ])


def check_text(reg: CollectorRegistry) -> dict:
    """The registry's text, both formats, parsed strictly: family -> samples."""
    om = generate_openmetrics(reg).decode()
    fams = {f.name: f for f in parse_openmetrics(om)}                   # raises on what OpenMetrics forbids
    text = generate_latest(reg).decode()
    seen = set()
    for f in text_string_to_metric_families(text):
        for x in f.samples:
            key = (x.name, tuple(sorted((k, v) for k, v in x.labels.items() if v)))
            assert key not in seen, key
            seen.add(key)
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode != 1 and "error" not in out.stdout + out.stderr, out.stdout + out.stderr
    return fams


def test_a_fleet_with_one_odd_node_renders_valid_text():
    state = FleetState()
    book = InventoryBook().watch(state)
    inv = pb.Inventory(hostname="host-a")
    inv.resources.add(type="GPU", vendor="nvidia", model="H100", id="gpu0", attributes={"uuid": "GPU-abc"})
    state.hello(pb.Hello(node_id="odd", boot_id="b", inventory=inv))
    state.ingest(odd_batch("odd", 1, time.time_ns()))
    reg = CollectorRegistry(auto_describe=False)
    fc = FleetCollector(state, book, compat_names=True)
    reg.register(fc)
    fams = check_text(reg)
    one = lambda fam, **lb: [x for x in fams[fam].samples if all(x.labels.get(k) == v for k, v in lb.items())]
    (util,) = one("hw_gpu_utilization_ratio")
    assert util.labels == {"device": "gpu0", "vendor": "nvidia", "key__name__": "spoof", "node": "odd",
                           "host_name": "host-a"}
    (chars,) = one("odd_chars_ratio")
    assert chars.labels == {"a_b": "1;2", "key_9lives": "4", "exported_node": "spoof", "exported_le": "0.5",
                            "quoted": 'a "b" \\ c\nd', "node": "odd", "host_name": "host-a"}
    assert [x.value for x in one("odd_requests")] == [5.0] and fams["odd_requests"].type == "counter"
    assert "odd_requests_total" not in fams
    assert [(x.value, fams["DCGM_FI_DEV_GPU_UTIL"].type) for x in one("DCGM_FI_DEV_GPU_UTIL")] == [(50.0, "gauge")]
    assert [x.labels for x in one("xpusense_node_connected")] == [{"node": "odd"}]
    assert [x.value for x in one("odd_dup_ratio")] == [9.0]
    assert {x.labels.get("exported_le") for x in one("odd_latency_seconds")} == {"x"}
    (sanitized,) = [f for f in fams.values() if f.name == "xpusense_collector_prometheus_sanitized"]
    by_reason = {x.labels["reason"]: x.value for x in sanitized.samples}
    assert set(by_reason) == set(REASONS)
    assert by_reason == {"label_renamed": 7, "label_empty": 1, "label_merged": 1, "name_renamed": 0,
                         "name_empty": 0, "name_taken": 3, "series_duplicate": 1}
    check_text(reg)                                   # four scrapes now (two per check): each adds its own
    assert fc.sanitized["label_empty"] == 4 and fc.sanitized["name_taken"] == 12


def test_cluster_mode_renders_through_the_same_rules():
    w = Worker(None, None, SimpleNamespace(), "w1", max_open_diagnoses_per_node=8)
    subject = node_subject("xpusense", "r1", 0, "odd")
    inv = pb.Inventory(hostname="host-a")
    inv.resources.add(type="GPU", vendor="nvidia", model="H100", id="gpu0")
    for data, kind in ((pb.Hello(node_id="odd", boot_id="b", inventory=inv).SerializeToString(), "hello"),
                       (odd_batch("odd", 1, time.time_ns()).SerializeToString(), None)):
        headers = {KIND: kind, "Xps-Session": "s-b"} if kind else {MSG_ID: msg_id("odd", "b", 1)}
        w._handle(0, SimpleNamespace(subject=subject, reply="", data=data,
                                     headers={**headers, RECEIVED: str(time.time_ns())}))
    index = FleetIndex()
    index.apply(w.nodes["odd"].encode("w1", 1), revision=1)
    book = InventoryBook().watch(index)
    for n in index.nodes.values():
        book._on_change(n, None)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(index, book, compat_names=True))
    fams = check_text(reg)
    (util,) = fams["hw_gpu_utilization_ratio"].samples
    assert util.labels.get("key__name__") == "spoof" and "" not in util.labels
