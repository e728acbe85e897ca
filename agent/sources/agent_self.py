"""The agent's own health: its CPU time and memory (from /proc via psutil), its stream and spool figures."""

from __future__ import annotations

from collections.abc import Callable

import psutil

from .base import COUNTER, NEARLINE, Sample, Source


class AgentSelfSource(Source):
    name = "agent"
    tiers = (NEARLINE,)

    def __init__(self, stream_status: Callable[[], dict]):
        self.stream_status = stream_status
        self._proc = psutil.Process()

    def collect(self, tier: str) -> list[Sample]:
        t = self._proc.cpu_times()
        st = self.stream_status()
        return [
            Sample("process.cpu.time", t.user + t.system, "s", {"process": "xpusense-agent"}, COUNTER),
            Sample("process.memory.usage", float(self._proc.memory_info().rss), "By", {"process": "xpusense-agent"}),
            Sample("xpusense.agent.stream.pending", float(st["pending_batches"]), "{batch}"),
            Sample("xpusense.agent.stream.dropped", float(st["dropped_samples"]), "{sample}", {}, COUNTER),
            Sample("xpusense.agent.stream.dropped_batches", float(st["dropped_batches"]), "{batch}", {}, COUNTER),
            Sample("xpusense.agent.stream.reconnects", float(st["reconnects"]), "{connection}", {}, COUNTER),
            Sample("xpusense.agent.spool.usage", float(st["spool_bytes"]), "By"),
            *self._spool(st.get("spool")),
        ]

    @staticmethod
    def _spool(sp: dict | None) -> list[Sample]:
        """The spool's health: whether it can write, batches it could not write (kept in memory
        instead), damaged records it skipped and set aside (also in dropped_batches)."""
        if sp is None:
            return []
        return [
            Sample("xpusense.agent.spool.writable", 1.0 if sp["state"] == "ok" else 0.0, "1"),
            Sample("xpusense.agent.spool.write_failures", float(sp["write_failures"]), "{batch}", {}, COUNTER),
            Sample("xpusense.agent.spool.damaged", float(sp["damaged_records"]), "{record}", {}, COUNTER),
        ]
