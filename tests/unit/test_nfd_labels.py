"""The NFD feature-file writer on a given inventory and clock: the labels, the file against NFD's
format, written only on a change or when half the expiry has passed, and its failures counted."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import pytest
from nfd_format import feature_file_problems, feature_labels

from xpusense.agent.config import load_agent
from xpusense.agent.nfd_labels import NfdFeatureFile, label_value, render
from xpusense.agent.sources.agent_self import AgentSelfSource
from xpusense.agent.sources.base import Event, Sample
from xpusense.common.config import ConfigError

T0 = 1_800_000_000.0


def gpu(i: int) -> dict:
    return {"type": "GPU", "vendor": "nvidia", "model": "A100-SXM4-40GB", "id": f"gpu{i}",
            "attributes": {"product": "NVIDIA-A100-SXM4-40GB", "memory": "40GB", "memory_mib": "40960",
                           "driver": "535.104.05", "architecture": "Ampere", "compute_capability": "8.0"},
            "interconnects": [{"type": "NVLink", "bandwidth": "600GB/s"}]}


def health(dev: str, ok: bool) -> Sample:
    return Sample("xpusense.accelerator.health", 1.0 if ok else 0.0, "1", {"device": dev, "vendor": "nvidia"})


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def writer(tmp_path):
    inv = {"resources": [{"type": "CPU", "model": "EPYC"}] + [gpu(i) for i in range(4)]}
    clock = Clock()
    w = NfdFeatureFile(str(tmp_path / "xpusense"), lambda: inv["resources"], expiry_s=600, check_s=60, clock=clock)
    return w, inv, clock


def text(w) -> str:
    with open(w.path) as f:
        return f.read()


def test_labels_follow_gpu_feature_discovery_and_the_file_follows_nfds_format(writer):
    w, _, clock = writer
    w.observe([health(f"gpu{i}", True) for i in range(4)], [])
    labels = feature_labels(text(w))
    assert feature_file_problems(text(w), datetime.fromtimestamp(clock.now, UTC)) == []
    assert labels == {
        "nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.memory": "40960", "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver.major": "535", "nvidia.com/cuda.driver.minor": "104",
        "nvidia.com/cuda.driver.rev": "05",
        "xpusense.io/gpu.vendor": "nvidia", "xpusense.io/gpu.model": "A100-SXM4-40GB", "xpusense.io/gpu.count": "4",
        "xpusense.io/gpu.memory": "40GB", "xpusense.io/gpu.interconnect": "NVLink",
        "xpusense.io/gpu.interconnect-bandwidth": "600GBps", "xpusense.io/gpu.driver-version": "535.104.05",
        "xpusense.io/gpu.health": "ok", "xpusense.io/gpu.healthy-count": "4"}
    assert "# +expiry-time=2027-01-15T08:10:00Z" in text(w).splitlines()   # T0 + 600 s, UTC
    assert os.listdir(os.path.dirname(w.path)) == ["xpusense"]             # the dot file was renamed


def test_written_only_on_a_change_or_when_half_the_expiry_has_passed(writer):
    w, inv, clock = writer
    w.observe([health(f"gpu{i}", True) for i in range(4)], [])
    first = os.stat(w.path)
    for _ in range(200):   # every round: the same health; an inventory check each 60 s
        clock.now += 1
        w.observe([health(f"gpu{i}", True) for i in range(4)], [])
    assert clock.now - T0 < 300 and os.stat(w.path).st_ino == first.st_ino and w.writes == 1
    w.observe([health("gpu2", False)], [])     # a health change is written at once
    assert feature_labels(text(w))["xpusense.io/gpu.health"] == "degraded" and w.writes == 2
    assert feature_labels(text(w))["xpusense.io/gpu.healthy-count"] == "3"
    inv["resources"] = inv["resources"][:-1]  # a GPU gone: seen at the next check (or with an event)
    w.observe([], [])
    assert w.writes == 2
    w.observe([], [Event("xid", "XID 13", "warning", "gpu0")])
    assert feature_labels(text(w))["nvidia.com/gpu.count"] == "3" and w.writes == 3
    w.observe([], [Event("health", "gpu2 answers again", "info", "gpu2", {"status": "ok"})])
    assert feature_labels(text(w))["xpusense.io/gpu.health"] == "ok" and w.writes == 4
    w.observe([], [Event("health", "gpu1 is lost", "critical", "gpu1", {"status": "lost"})])
    assert feature_labels(text(w))["xpusense.io/gpu.healthy-count"] == "2" and w.writes == 5
    clock.now += 299
    w.observe([], [])
    assert w.writes == 5
    clock.now += 1                             # half of the 600 s expiry since the last write
    w.observe([], [])
    assert w.writes == 6 and feature_file_problems(text(w), datetime.fromtimestamp(clock.now + 299, UTC)) == []


def test_a_failed_write_is_counted_and_tried_again(writer, tmp_path):
    w, _, clock = writer
    w.path = str(tmp_path / "missing" / "xpusense")
    w.observe([], [])
    assert w.write_failures == 1 and w.writes == 0
    (tmp_path / "missing").mkdir()
    clock.now += 60
    w.observe([], [])
    assert w.writes == 1 and feature_labels(text(w))["xpusense.io/gpu.health"] == "unknown"
    big = {f"xpusense.io/l{i}": "v" * 63 for i in range(1000)}
    assert not w.write(big, clock.now) and w.oversized == 1
    # The agent's own metrics carry the counters.
    counted = {s.name: s.value for s in AgentSelfSource._nfd(w.describe())}
    assert counted == {"xpusense.agent.nfd.writes": 1.0, "xpusense.agent.nfd.write_failures": 1.0,
                       "xpusense.agent.nfd.oversized": 1.0}


def test_values_become_label_values():
    assert label_value("900GB/s") == "900GBps" and label_value("Ada Lovelace") == "Ada-Lovelace"
    assert label_value("-x" * 40) == ("x-" * 31 + "x") and label_value("(none)") == "none"


def test_the_format_check_finds_what_nfd_would_drop_or_mislabel():
    now = datetime.fromtimestamp(T0, UTC)
    good = render({"xpusense.io/gpu.count": "8"}, datetime.fromtimestamp(T0 + 60, UTC))
    assert feature_file_problems(good, now) == []
    assert feature_file_problems(good, datetime.fromtimestamp(T0 + 61, UTC)) == [
        "line 3: expired at 2027-01-15T08:01:00+00:00 (NFD ignores it)"]
    bad = ("# +expiry-time=2030-01-01 00:00\n# +expirytime=2030-01-01T00:00:00Z\nxpusense.io/gpu.count=8\n"
           "# +expiry-time=2030-01-01T00:00:00Z\ncount=8\nxpusense.io/gpu.bw=900GB/s\nkubernetes.io/gpu=1\n"
           "xpusense.io/flag\nxpusense.io/gpu.count=7\n")
    assert feature_file_problems(bad, now) == [
        "line 1: expiry-time '2030-01-01 00:00' is not RFC 3339", "line 2: unknown directive 'expirytime'",
        "line 3: a feature before any # +expiry-time (it would never expire)",
        "line 5: 'count' has no namespace (NFD prefixes feature.node.kubernetes.io/)",
        "line 6: value '900GB/s' is not a label value (63 characters, [A-Za-z0-9._-])",
        "line 7: namespace 'kubernetes.io' is not a DNS subdomain NFD accepts",
        "line 8: 'xpusense.io/flag' has no value (NFD would label it 'true')",
        "line 9: xpusense.io/gpu.count again"]


def test_config_keys(tmp_path):
    p = tmp_path / "agent.toml"
    p.write_text('[k8s]\nnfd_feature_file = "/x/xpusense"\nnfd_expiry_s = 30\n')
    with pytest.raises(ConfigError, match="nfd_expiry_s"):
        load_agent(str(p), env={})
    p.write_text('[k8s]\nnfd_feature_file = "/x/xpusense"\n')
    k = load_agent(str(p), env={}).k8s
    assert (k.nfd_feature_file, k.nfd_expiry_s, k.nfd_check_s, k.enabled) == ("/x/xpusense", 600.0, 60.0, False)
