"""What a diagnosis rule is: it reads the node's recent series and returns findings.

A rule module exports `FAMILY`, a RuleFamily: its `[diagnosis.NAME]` config keys beside its code and
how it is built from the checked table and the node's context; agent/diagnosis/registry.py lists
them. A Finding names the symptom, the cause, the remedy and the evidence (series, values, window);
the engine (engine.py) opens a diagnosis once a finding holds for `open_after_s` and closes it once
the finding has been gone for `close_after_s`, so a rule only says what it sees now. A rule may take
a lower bar for a diagnosis already open (hysteresis on the threshold too): `held` says which are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from .recent import Recent, Series

# The rules, by name (diagnosis.rule on the events; docs/diagnosis.md has one entry each).
PCIE_CONTENTION = "pcie_contention"
NUMA_MISPLACEMENT = "numa_misplacement"
NETWORK_STACK = "network_stack"
CLOCKS_HELD_DOWN = "clocks_held_down"
DEVICE_MEMORY_PRESSURE = "device_memory_pressure"
CPU_STARVATION = "cpu_starvation"


@dataclasses.dataclass(frozen=True)
class Evidence:
    series: str                      # the metric name
    labels: Mapping[str, str]
    values: tuple[float, ...]        # what the rule looked at (at most MAX_VALUES, the newest)
    window_s: float
    summary: str                     # e.g. "coefficient of variation 0.42 over 60 s (threshold 0.3)"

    MAX_VALUES: ClassVar[int] = 16

    @classmethod
    def of(cls, s: Series, window_s: float, summary: str) -> Evidence:
        return cls(s.name, dict(s.labels), tuple(round(v, 6) for v in s.values[-cls.MAX_VALUES:]), window_s, summary)

    def as_json(self) -> dict[str, Any]:
        return {"series": self.series, "labels": dict(self.labels), "values": list(self.values),
                "window_s": self.window_s, "summary": self.summary}


@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str
    device: str                      # the accelerator it concerns ("" for the node)
    symptom: str
    cause: str
    remedy: str
    evidence: tuple[Evidence, ...]
    subject: str = ""                # what else tells two findings of one rule and device apart (pid, cgroup, NIC)
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)   # process.pid, cgroup, k8s.pod.name ...

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.device, self.subject)


class Rule:
    """One diagnosis rule. `reads` names every series it looks at (the engine keeps only those)."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]]

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        """What holds now. `held`: (device, subject) of this rule's diagnoses open now."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Context:
    """What rules may need beyond the series: the accelerators' processes and the host's files."""

    processes: Callable[[], dict[int, set[str]]] = dict   # pid -> accelerators it uses (NVML / npu-smi)
    procfs: str = "/proc"
    sysfs: str = "/sys"


@dataclasses.dataclass(frozen=True)
class RuleFamily:
    name: str
    schema: dict[str, Any]                              # xpusense.common.config Keys; "enabled" included
    build: Callable[[Any, Context], Rule | None]        # the checked table, the context -> the rule
