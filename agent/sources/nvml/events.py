"""XID errors, double-bit ECC errors and GPU health events from an NVML event set, on a thread.

nvmlEventSetWait blocks, so a thread of its own waits on the set and turns what arrives into
`Event`s on a queue that the source drains every round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ..base import Event
from .device import VENDOR, Gpu
from .health import Health
from .library import code, handle_key
from .states import ReadingStates

log = logging.getLogger("xpusense.agent.nvml")

XID_EVENT, DBE_EVENT, SBE_EVENT = 0x8, 0x2, 0x1
MIG_CONFIG_EVENT = 0x100
GPU_UNAVAILABLE_EVENT, GPU_RECOVERY_EVENT = 0x4000, 0x8000
WATCHED_EVENTS = XID_EVENT | DBE_EVENT | MIG_CONFIG_EVENT | GPU_UNAVAILABLE_EVENT | GPU_RECOVERY_EVENT


class EventWatcher:
    def __init__(self, nv: Any, gpus: list[Gpu], out: queue.Queue[Event], wait_ms: int, states: ReadingStates,
                 health: Health):
        self.nv = nv
        self.gpus = gpus
        self.out = out
        self.wait_ms = wait_ms
        self.states = states
        self.health = health
        self._set: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._by_handle: dict[int, Gpu | None] = {}

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
        nv = self.nv
        if self._set is None:
            return
        try:
            mask = nv.nvmlDeviceGetSupportedEventTypes(g.handle) & WATCHED_EVENTS
            if not mask:
                self.states.mark_unsupported(g.id, "events", "no XID/ECC events supported")
                return
            nv.nvmlDeviceRegisterEvents(g.handle, mask, self._set)
        except nv.NVMLError as e:
            self.states.mark_unsupported(g.id, "events", str(e))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nvml-events", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        nv = self.nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._set, self.wait_ms)
            except nv.NVMLError as e:
                if code(e) == nv.NVML_ERROR_TIMEOUT:
                    continue
                if self._stop.is_set():
                    return
                log.warning("NVML event wait failed: %s", e)
                self._stop.wait(1.0)
                continue
            g = self._gpu_for(data.device)
            if g is not None and data.eventType == MIG_CONFIG_EVENT:
                g.mig_changed = True          # the next round reads the MIG layout again
                continue
            self.out.put(event_from(g, data))

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
    now = time.time_ns()
    if data.eventType == XID_EVENT:
        attrs["xid"] = str(data.eventData)
        return Event("xid", f"{dev} ({name}): XID {data.eventData}", "critical", dev, attrs, now)
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
