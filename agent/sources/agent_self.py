"""The agent's own health: its CPU time, memory and threads (from /proc via psutil) and its stream figures.

The process.* series carry the agent's identity as labels (`pid`, `executable`, `started`, and
`process` = xpusense-agent); at the OTLP edge they become the attributes of a process resource
(common/semconv.py).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import psutil

from xpusense.common.supervise import TASKS

from .base import COUNTER, NEARLINE, Sample, Source

MODES = ("user", "system")


def process_labels(pid: int, exe: str, create_time_s: float) -> dict[str, str]:
    started = datetime.datetime.fromtimestamp(create_time_s, datetime.UTC).isoformat(timespec="milliseconds")
    return {"process": "xpusense-agent", "pid": str(pid), "executable": os.path.basename(exe),
            "started": started.replace("+00:00", "Z")}


def cpu_samples(labels: dict[str, str], cur: dict[str, float], prev: tuple[float, dict[str, float]] | None,
                now_s: float, cpus: int) -> list[Sample]:
    """process.cpu.time per mode and, from the previous reading, process.cpu.utilization: the CPU time
    of each mode over the elapsed time and the number of CPUs."""
    out = [Sample("process.cpu.time", cur[m], "s", {**labels, "state": m}, COUNTER) for m in MODES]
    if prev is not None and now_s > prev[0] and cpus > 0:
        span = (now_s - prev[0]) * cpus
        out += [Sample("process.cpu.utilization", max(cur[m] - prev[1][m], 0.0) / span, "1", {**labels, "state": m})
                for m in MODES]
    return out


class AgentSelfSource(Source):
    name = "agent"
    tiers = (NEARLINE,)

    def __init__(self, stream_status: Callable[[], dict], nfd_status: Callable[[], dict | None] = lambda: None):
        self.stream_status, self.nfd_status = stream_status, nfd_status
        self._proc = psutil.Process()
        try:
            exe = self._proc.exe()
        except (psutil.Error, OSError):
            exe = ""
        self._labels = process_labels(self._proc.pid, exe, self._proc.create_time())
        self._prev: tuple[float, dict[str, float]] | None = None

    def collect(self, tier: str) -> list[Sample]:
        t = self._proc.cpu_times()
        now = time.monotonic()
        cur = {"user": t.user, "system": t.system}
        cpu = cpu_samples(self._labels, cur, self._prev, now, psutil.cpu_count() or 0)
        self._prev = (now, cur)
        st = self.stream_status()
        return cpu + [
            Sample("process.memory.usage", float(self._proc.memory_info().rss), "By", dict(self._labels)),
            Sample("process.thread.count", float(self._proc.num_threads()), "{thread}", dict(self._labels)),
            Sample("xpusense.agent.task.restarts", float(TASKS.total()), "{restart}", {}, COUNTER),
            Sample("xpusense.agent.stream.pending", float(st["pending_batches"]), "{batch}"),
            Sample("xpusense.agent.stream.dropped", float(st["dropped_samples"]), "{sample}", {}, COUNTER),
            Sample("xpusense.agent.stream.dropped_batches", float(st["dropped_batches"]), "{batch}", {}, COUNTER),
            Sample("xpusense.agent.stream.reconnects", float(st["reconnects"]), "{connection}", {}, COUNTER),
            Sample("xpusense.agent.stream.series", float(st["series_refs"]), "{series}"),
            Sample("xpusense.agent.stream.series_retired", float(st["series_retired"]), "{series}", {}, COUNTER),
            Sample("xpusense.agent.stream.series_unnumbered", float(st["series_unnumbered"]), "{series}", {}, COUNTER),
            Sample("xpusense.agent.stream.impossible_acks", float(st["impossible_acks"]), "{message}", {}, COUNTER),
            Sample("xpusense.agent.spool.usage", float(st["spool_bytes"]), "By"),
            *self._spool(st.get("spool")),
            *self._nfd(self.nfd_status()),
        ]

    @staticmethod
    def _nfd(nfd: dict | None) -> list[Sample]:
        """The NFD feature file's writes, failed writes and files over NFD's size limit ([k8s] nfd_*)."""
        if nfd is None:
            return []
        return [Sample(f"xpusense.agent.nfd.{k}", float(nfd[k]), "{write}", {}, COUNTER)
                for k in ("writes", "write_failures", "oversized")]

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
