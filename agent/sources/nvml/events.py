"""XID errors, double-bit ECC errors and GPU health events from an NVML event set, on a thread.

nvmlEventSetWait blocks, so a thread of its own (EventWatcher) waits on the set and turns what
arrives into `Event`s on a queue that the source drains every round; each XID is also counted
per GPU and code (code_counts.py) as it arrives."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ..base import Event
from ..code_counts import CodeCounts
from .device import VENDOR, Gpu
from .health import Health
from .library import GPU_IS_LOST, TIMEOUT, code, handle_key
from .states import ReadingStates

log = logging.getLogger("xpusense.agent.nvml")

XID_EVENT, DBE_EVENT, SBE_EVENT = 0x8, 0x2, 0x1
MIG_CONFIG_EVENT = 0x100
GPU_UNAVAILABLE_EVENT, GPU_RECOVERY_EVENT = 0x4000, 0x8000
WATCHED_EVENTS = XID_EVENT | DBE_EVENT | MIG_CONFIG_EVENT | GPU_UNAVAILABLE_EVENT | GPU_RECOVERY_EVENT
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})   # k8s-device-plugin: not a GPU health problem
UNKNOWN_XID = 999
NO_INSTANCE = 0xFFFFFFFF


def xid_class(xid: int) -> str:
    """NVIDIA's k8s-device-plugin ignores 13, 31, 43, 45, 68 and 109 for GPU health: application
    errors (a kernel's bad memory access, a reset channel, a killed context...) that leave the GPU
    fine for the next job: `warning`, class `application`. Every other XID is `critical`, class
    `hardware`; 999 is the driver's "unknown Xid" (nvml.h), class `unknown`, also critical."""
    return "application" if xid in APPLICATION_XIDS else "unknown" if xid == UNKNOWN_XID else "hardware"


class EventWatcher:
    """In MIG mode an XID that belongs to one instance carries its GPU and compute instance ids
    (0xFFFFFFFF otherwise), kept as attributes. nvmlEventSetWait answers GPU_IS_LOST at every call
    once a GPU of the set has fallen off the bus: the thread then finds which GPUs answer
    GPU_IS_LOST, reports them lost (one health event each, shared with the rounds) and waits on a
    new set without them. Any other failure is logged once per streak and retried with back-off."""

    def __init__(self, nv: Any, gpus: list[Gpu], out: queue.Queue[Event], wait_ms: int, states: ReadingStates,
                 health: Health, xids: CodeCounts | None = None):
        self.nv = nv
        self.xids = xids
        self.gpus = gpus
        self.out = out
        self.wait_ms = wait_ms
        self.states = states
        self.health = health
        self._set: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._by_handle: dict[int, Gpu | None] = {}
        self._lock = threading.Lock()             # the set and who is in it: the thread rebuilds it
        self.registered: list[Gpu] = []

    def start(self) -> None:
        nv = self.nv
        try:
            self._set = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            self.states.mark_unsupported("*", "events", str(e))
            return
        for g in self.gpus:
            if g.opened and not g.lost:
                self.add(g)

    def add(self, g: Gpu) -> None:
        """Register g's events (at start, or when a GPU that failed at start is opened)."""
        with self._lock:
            if self._set is None or not self._register(g, self._set):
                return
            self.registered.append(g)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nvml-events", daemon=True)
            self._thread.start()

    def _register(self, g: Gpu, event_set: Any) -> bool:
        nv = self.nv
        try:
            mask = nv.nvmlDeviceGetSupportedEventTypes(g.handle) & WATCHED_EVENTS
            if not mask:
                self.states.mark_unsupported(g.id, "events", "no XID/ECC events supported")
                return False
            nv.nvmlDeviceRegisterEvents(g.handle, mask, event_set)
        except nv.NVMLError as e:
            self.states.mark_unsupported(g.id, "events", str(e))
            return False
        return True

    def _loop(self) -> None:
        nv = self.nv
        failures = 0
        while not self._stop.is_set() and self._set is not None:
            try:
                data = nv.nvmlEventSetWait(self._set, self.wait_ms)
            except nv.NVMLError as e:
                rc = code(e)
                if rc == TIMEOUT:
                    failures = 0
                    continue
                if self._stop.is_set():
                    return
                if rc == GPU_IS_LOST and self._drop_lost(str(e)):
                    continue
                failures += 1
                delay = min(60.0, 2.0 ** (failures - 1))
                if failures in (1, 10, 100) or failures % 1000 == 0:
                    log.warning("NVML event wait failed (%s), %d time(s) in a row; trying again in %.0f s",
                                e, failures, delay)
                self._stop.wait(delay)
                continue
            failures = 0
            g = self._gpu_for(data.device)
            if g is not None and data.eventType == MIG_CONFIG_EVENT:
                g.mig_changed = True          # the next round reads the MIG layout again
                continue
            if g is not None and data.eventType == XID_EVENT and self.xids is not None:
                self.xids.add(g.labels, str(int(data.eventData)))
            self.out.put(event_from(g, data))

    def _drop_lost(self, why: str) -> bool:
        """The set said a GPU is lost: report the GPUs that say so, and wait on a set without them.
        False when none of them says so (then the failure is retried with back-off)."""
        nv = self.nv
        lost = []
        for g in list(self.registered):
            try:
                nv.nvmlDeviceGetSupportedEventTypes(g.handle)
            except nv.NVMLError as e:
                if code(e) == GPU_IS_LOST:
                    lost.append(g)
        if not lost:
            return False
        for g in lost:
            self.health.lost(g, f"reported by the event set ({why})")
        try:
            fresh = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.warning("NVML events: cannot make a new event set (%s)", e)
            return False
        with self._lock:
            old, self._set = self._set, fresh
            self.registered = [g for g in self.registered if g not in lost and self._register(g, self._set)]
            try:
                nv.nvmlEventSetFree(old)
            except nv.NVMLError:
                pass
            if not self.registered:
                nv.nvmlEventSetFree(self._set)
                self._set = None
        log.info("NVML events: %s lost; watching %s", ", ".join(g.id for g in lost),
                 ", ".join(g.id for g in self.registered) or "no GPU any more")
        return True

    def _gpu_for(self, handle: Any) -> Gpu | None:
        key = handle_key(handle)
        if key not in self._by_handle:
            idx = None
            try:
                idx = self.nv.nvmlDeviceGetIndex(handle)
            except self.nv.NVMLError:
                pass
            self._by_handle[key] = next((g for g in self.gpus if g.index == idx), None)
        return self._by_handle[key]

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.wait_ms / 1000 + 2)
        with self._lock:
            if self._set is not None:
                try:
                    self.nv.nvmlEventSetFree(self._set)
                except self.nv.NVMLError:
                    pass
                self._set = None


def event_from(g: Gpu | None, data: Any) -> Event:
    dev = g.id if g else "gpu?"
    name = g.name if g else ""
    attrs = {"vendor": VENDOR, "event_type": hex(data.eventType)}
    if g:
        attrs["uuid"] = g.info.get("uuid", "")
    where = ""
    for attr, field in (("mig_instance", "gpuInstanceId"), ("compute_instance", "computeInstanceId")):
        v = getattr(data, field, NO_INSTANCE)
        if v != NO_INSTANCE:
            attrs[attr] = str(v)
    if "mig_instance" in attrs:
        where = f" in MIG instance {attrs['mig_instance']}" + (
            f" (compute instance {attrs['compute_instance']})" if "compute_instance" in attrs else "")
    now = time.time_ns()
    if data.eventType == XID_EVENT:
        xid = int(data.eventData)
        cls = attrs["xid_class"] = xid_class(xid)
        attrs["xid"] = str(xid)
        text = {"application": "an application error (the GPU stays usable)",
                "unknown": "an XID the driver could not identify (999)", "hardware": "a GPU error"}[cls]
        return Event("xid", f"{dev} ({name}): XID {xid}{where}: {text}",
                     "warning" if cls == "application" else "critical", dev, attrs, now)
    if data.eventType == DBE_EVENT:
        return Event("ecc", f"{dev} ({name}): double-bit ECC error", "critical", dev, attrs, now)
    if data.eventType == GPU_UNAVAILABLE_EVENT:
        return Event("health", f"{dev} ({name}): GPU unavailable", "critical", dev, attrs, now)
    if data.eventType == GPU_RECOVERY_EVENT:
        attrs["recovery_action"] = str(data.eventData)
        return Event("health", f"{dev} ({name}): recovery action {data.eventData} requested", "warning",
                     dev, attrs, now)
    return Event("nvml_event", f"{dev} ({name}): event {hex(data.eventType)} data {data.eventData}",
                 "warning", dev, attrs, now)
