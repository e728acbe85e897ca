"""Asking NVML one reading of one device: the call made only when the reading is due, its error
judged by code (library.classify) and kept in the reading's state, health told of what it means."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import library
from .device import Gpu
from .health import Health
from .states import ReadingStates

MIG_MONITOR_HINT = ("MIG is enabled: reading the whole GPU needs the MIG monitor capability "
                    "(in a container NVIDIA_MIG_MONITOR_DEVICES=all and CAP_SYS_ADMIN; docs/security.md); "
                    "each MIG instance is still read through its own handle")


class GpuLost(Exception):
    """A call answered GPU_IS_LOST: the GPU's round ends here."""


class Asker:
    def __init__(self, nv: Any, states: ReadingStates, health: Health):
        self.nv = nv
        self.states = states
        self.health = health

    def __call__(self, g: Gpu, what: str, fn: Callable[[], Any], dev: str | None = None) -> Any:
        """fn() when the reading is due on `dev` (default: g), else None. NVML errors become the
        reading's state; GPU_IS_LOST raises GpuLost."""
        dev = dev or g.id
        now = time.monotonic()
        if not self.states.due(dev, what, now):
            return None
        try:
            v = fn()
        except self.nv.NVMLError as e:
            self.failed(g, what, library.code(e), str(e), now, dev)
            return None
        except library.Unreadable as e:
            self.states.failed(dev, what, library.UNSUPPORTED, str(e), now)
            return None
        self.states.succeeded(dev, what)
        self.health.answered(g, what)
        return v

    def failed(self, g: Gpu, what: str, rc: int | None, why: str, now: float, dev: str | None = None) -> None:
        """Record an error code the call returned (raised, or per field / per metric in a struct)."""
        kind = library.classify(rc)
        if kind == library.LOST:
            raise GpuLost(why)
        if kind == library.RESET:
            self.health.reset_required(g, what, why)
        if rc == library.NO_PERMISSION and g.mig and dev in (None, g.id):
            why = f"{why}: {MIG_MONITOR_HINT}"
        self.states.failed(dev or g.id, what, library.UNSUPPORTED if kind == library.UNSUPPORTED else library.TRANSIENT,
                           why, now)

    def ok(self, dev: str, what: str) -> None:
        self.states.succeeded(dev, what)
