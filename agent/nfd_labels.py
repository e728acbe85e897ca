"""Node labels from this node's inventory and accelerator health, written as a Node Feature Discovery
feature file ([k8s] nfd_feature_file): GPU feature discovery's label names for NVIDIA GPUs, and
`xpusense.io/<type>.*` for every accelerator type. Rewritten only when the labels change or half
the expiry has passed; docs/kubernetes.md, "Node labels", lists the labels."""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from xpusense.common.fsync import fsync_dir

from .sources.base import Event, Sample

log = logging.getLogger("xpusense.agent.nfd")

MAX_FILE_BYTES = 65536      # NFD's local source ignores a larger feature file
MAX_VALUE_CHARS = 63        # Kubernetes label values
HEALTH_METRIC = "xpusense.accelerator.health"
ACCELERATORS = ("GPU", "NPU")
_NOT_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(text: str) -> str:
    """A Kubernetes label value: [A-Za-z0-9._-], at most 63 characters, alphanumeric at both ends
    ('900GB/s' -> '900GBps', 'Ada Lovelace' -> 'Ada-Lovelace')."""
    v = _NOT_VALUE.sub("-", text.replace("/s", "ps")).strip("-_.")
    return v[:MAX_VALUE_CHARS].rstrip("-_.")


def _common(values: Iterable[str]) -> str:
    """The most frequent non-empty value (the first seen among equals); '' when none."""
    counted = Counter(v for v in values if v)
    return counted.most_common(1)[0][0] if counted else ""


def _gfd_labels(gpus: list[dict]) -> dict[str, str]:
    """GPU feature discovery's names and value formats (NVIDIA's k8s-device-plugin docs)."""
    attrs = [g.get("attributes", {}) for g in gpus]
    out = {"nvidia.com/gpu.count": str(len(gpus)),
           "nvidia.com/gpu.product": _common(a.get("product", "") for a in attrs),
           "nvidia.com/gpu.memory": _common(a.get("memory_mib", "") for a in attrs),   # MiB
           "nvidia.com/gpu.family": _common(a.get("architecture", "") for a in attrs).lower()}
    major, _, minor = _common(a.get("compute_capability", "") for a in attrs).partition(".")
    out["nvidia.com/gpu.compute.major"], out["nvidia.com/gpu.compute.minor"] = major, minor
    driver = _common(a.get("driver", "") for a in attrs).split(".")
    for part, value in zip(("major", "minor", "rev"), driver, strict=False):
        out[f"nvidia.com/cuda.driver.{part}"] = value
    return out


def node_labels(resources: list[dict], unhealthy: set[str], healthy: set[str]) -> dict[str, str]:
    """Labels for the inventory's accelerators; `unhealthy`/`healthy`: device ids by their last health
    reading (a type none of whose devices has one yet is 'unknown'). Empty values are left out."""
    out: dict[str, str] = {}
    for kind in ACCELERATORS:
        devs = [r for r in resources if r.get("type") == kind]
        if not devs:
            continue
        attrs = [d.get("attributes", {}) for d in devs]
        links = [i for d in devs for i in d.get("interconnects", [])]
        ids = {str(d.get("id", "")) for d in devs}
        bad = ids & unhealthy
        p = f"xpusense.io/{kind.lower()}."
        out.update({
            p + "vendor": _common(d.get("vendor", "") for d in devs),
            p + "model": _common(d.get("model", "") for d in devs),
            p + "count": str(len(devs)),
            p + "memory": _common(a.get("memory", "") for a in attrs),
            p + "interconnect": _common(i.get("type", "") for i in links),
            p + "interconnect-bandwidth": _common(str(i.get("bandwidth", "")) for i in links),
            p + "driver-version": _common(a.get("driver") or a.get("driver_version", "") for a in attrs),
            p + "health": "degraded" if bad else "ok" if ids & healthy else "unknown",
            p + "healthy-count": str(len(ids - bad)),
        })
        nvidia = [d for d in devs if d.get("vendor") == "nvidia"]
        if kind == "GPU" and nvidia:
            out.update(_gfd_labels(nvidia))
    return {k: label_value(v) for k, v in out.items() if label_value(v)}


def render(labels: dict[str, str], expires: datetime) -> str:
    """The feature file: a comment, the expiry directive (RFC 3339, UTC), one `name=value` a line."""
    lines = ["# node labels written by xpusense-agent from this node's inventory and health",
             f"# +expiry-time={expires.strftime('%Y-%m-%dT%H:%M:%SZ')}"]
    return "\n".join(lines + [f"{k}={v}" for k, v in sorted(labels.items())]) + "\n"


class NfdFeatureFile:
    """Keeps the feature file at `path` in step with the node: fed every round's samples and events
    (health readings and health events change the labels at once; events and every `check_s` make it read the inventory
    again), it writes only when the labels differ from the file's or half of `expiry_s` has passed."""

    def __init__(self, path: str, resources: Callable[[], list[dict]], expiry_s: float = 600.0,
                 check_s: float = 60.0, clock: Callable[[], float] = time.time):
        self.path, self.resources, self.expiry_s, self.check_s, self.clock = path, resources, expiry_s, check_s, clock
        self.unhealthy: set[str] = set()
        self.healthy: set[str] = set()
        self.written: dict[str, str] | None = None
        self.writes = self.write_failures = self.oversized = 0   # counters (describe())
        self._checked = self._refresh_at = float("-inf")
        self._health_changed = True

    def observe(self, samples: Iterable[Sample], events: list[Event]) -> None:
        for s in samples:   # the sources' health readings (offline tier)...
            if s.name == HEALTH_METRIC and (dev := s.labels.get("device")):
                self._health(dev, s.value >= 1.0)
        for e in events:    # ...and their health events, sent as soon as a device changes
            if e.type == "health" and e.device:
                self._health(e.device, e.attributes.get("status", "").strip().lower() == "ok")
        now = self.clock()
        if not (events or self._health_changed or now - self._checked >= self.check_s or now >= self._refresh_at):
            return
        self._checked, self._health_changed = now, False
        labels = node_labels(self.resources(), self.unhealthy, self.healthy)
        if labels != self.written or now >= self._refresh_at:
            self.write(labels, now)
        else:
            log.debug("NFD feature file %s: %d labels unchanged", self.path, len(labels))

    def _health(self, dev: str, ok: bool) -> None:
        if (dev in self.healthy) != ok or (dev in self.unhealthy) == ok:
            self._health_changed = True
            (self.healthy if ok else self.unhealthy).add(dev)
            (self.unhealthy if ok else self.healthy).discard(dev)

    def write(self, labels: dict[str, str], now: float) -> bool:
        """The file replaced by a dot file in the same folder (which NFD ignores), fsync'd and renamed."""
        text = render(labels, datetime.fromtimestamp(now + self.expiry_s, UTC)).encode()
        if len(text) > MAX_FILE_BYTES:
            self.oversized += 1
            log.error("NFD feature file %s: %d bytes is over NFD's %d-byte limit: not written",
                      self.path, len(text), MAX_FILE_BYTES)
            return False
        directory, name = os.path.split(os.path.abspath(self.path))
        tmp = os.path.join(directory, "." + name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, text)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(directory)
        except OSError as e:
            self.write_failures += 1
            log.warning("NFD feature file %s: cannot write it (%s); tried again at the next check", self.path, e)
            return False
        self.writes += 1
        self.written, self._refresh_at = labels, now + self.expiry_s / 2
        log.info("NFD feature file %s: %d labels written", self.path, len(labels))
        return True

    def describe(self) -> dict:
        return {"path": self.path, "labels": len(self.written or {}), "writes": self.writes,
                "write_failures": self.write_failures, "oversized": self.oversized}


def build_nfd_writer(cfg, resources: Callable[[], list[dict]]) -> NfdFeatureFile | None:
    """From the agent config's [k8s] table: None when `nfd_feature_file` is not set."""
    k = cfg.k8s
    if not k.nfd_feature_file:
        return None
    return NfdFeatureFile(k.nfd_feature_file, resources, expiry_s=k.nfd_expiry_s, check_s=k.nfd_check_s)
