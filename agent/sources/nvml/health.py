"""GPU health as the NVML source sees it: ok, reset_required, lost; each change one event.

gpud and NVIDIA's device plugin treat a GPU that answers NVML_ERROR_RESET_REQUIRED as failed: it
keeps its place (the readings are asked again with back-off, and a reset by the operator brings it
back), but a critical health event says so once, and one informational event says when every reading
that asked for the reset answers again. GPU_IS_LOST is final for the run: one critical event and the
GPU is left out. The round and the event thread both report, so changes are made under a lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..base import Event, Sample
from .device import VENDOR, Gpu

log = logging.getLogger("xpusense.agent.nvml")

OK, RESET_REQUIRED, LOST = "ok", "reset_required", "lost"


class Health:
    def __init__(self, out: queue.Queue[Event]):
        self.out = out
        self._lock = threading.Lock()

    def lost(self, g: Gpu, why: str) -> bool:
        """Mark g lost; True the first time (the caller then stops using it)."""
        with self._lock:
            if g.lost:
                return False
            g.lost = True
        log.error("%s (%s) is lost: %s; the other GPUs go on", g.id, g.name, why)
        self._event(g, LOST, "critical", f"{g.id} ({g.name}, {g.info.get('pci_bus_id', '?')}) is lost "
                                         f"(GPU_IS_LOST: fell off the bus or the driver gave up on it): {why}")
        return True

    def reset_required(self, g: Gpu, what: str, why: str) -> None:
        with self._lock:
            first = not g.reset_required
            g.reset_required.add(what)
        if first:
            log.error("%s (%s) needs a reset (%s answered: %s); its readings are retried with back-off",
                      g.id, g.name, what, why)
            self._event(g, RESET_REQUIRED, "critical",
                        f"{g.id} ({g.name}) requires a GPU reset: {what} answered {why}. Drain it and reset "
                        f"it (nvidia-smi -r -i {g.index}) or reboot the node")

    def answered(self, g: Gpu, what: str) -> None:
        """A reading answered: if it was one that asked for a reset, the GPU may be well again."""
        if what not in g.reset_required:
            return
        with self._lock:
            g.reset_required.discard(what)
            recovered = not g.reset_required
        if recovered:
            log.info("%s (%s): every reading that asked for a reset answers again", g.id, g.name)
            self._event(g, OK, "info", f"{g.id} ({g.name}) answers again after requiring a reset", RESET_REQUIRED)

    @staticmethod
    def status(g: Gpu) -> str:
        return LOST if g.lost else RESET_REQUIRED if g.reset_required else OK

    def samples(self, gpus: list[Gpu]) -> list[Sample]:
        return [Sample("xpusense.accelerator.health", 1.0 if self.status(g) == OK else 0.0, "1",
                       {**g.labels, "status": self.status(g)}) for g in gpus]

    def _event(self, g: Gpu, status: str, severity: str, message: str, previous: str = "") -> None:
        attrs = {"vendor": VENDOR, "status": status, "uuid": g.info.get("uuid", ""),
                 "pci_bus_id": g.info.get("pci_bus_id", "")}
        if previous:
            attrs["previous"] = previous
        self.out.put(Event("health", message, severity, g.id, attrs, time.time_ns()))

    def cannot_open(self, g: Gpu, why: str) -> None:
        """A GPU NVML counts but whose handle or identity it refuses at start."""
        self._event(g, LOST, "critical", f"GPU {g.index} cannot be opened at start: {why}")
