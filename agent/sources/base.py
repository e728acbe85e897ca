"""The one interface every source of measurements has (host, NVML, npu-smi, eBPF probes).

`setup()` finds out whether the source can run here and raises `Unavailable` with a reason a person
can act on; `collect(tier)` returns samples for one tier; `close()` releases what setup took.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from xpusense.common.measures import COUNTER, GAUGE, HISTOGRAM, NEARLINE, OFFLINE, REALTIME, TIERS

# Sources import the tier and kind names from here, with the interface they implement.
__all__ = ["COUNTER", "GAUGE", "HISTOGRAM", "NEARLINE", "OFFLINE", "REALTIME", "TIERS", "Event", "Sample",
           "Source", "SourceError", "SourceFamily", "Unavailable", "stamp"]


class Unavailable(Exception):
    """This source cannot run on this host; the message says why and what to do about it."""


class SourceError(Exception):
    """A round of a source failed (bad tool output, a vanished device); the next round may work.

    `samples` holds what the round could still read: it is kept, and the error is reported.
    """

    def __init__(self, message: str, samples: list[Sample] | None = None):
        super().__init__(message)
        self.samples = samples or []


@dataclasses.dataclass(slots=True)
class Sample:
    name: str
    value: float
    unit: str
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    kind: str = GAUGE
    time_ns: int = 0
    # For histograms: ascending upper bounds and len(bounds)+1 cumulative counts.
    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class Event:
    type: str
    message: str
    severity: str = "info"
    device: str = ""
    attributes: dict[str, str] = dataclasses.field(default_factory=dict)
    time_ns: int = 0
    id: str = ""


class Source:
    """Base class: subclasses set `name` and `tiers`, and override setup/collect/close."""

    name: ClassVar[str] = ""
    # Tiers this source has something for; the tier loop calls collect() only for these.
    tiers: ClassVar[tuple[str, ...]] = ()
    # None: every sample of every round is sent. A number: the tier loop sends a series' sample only
    # when it differs from the last one sent (then once more when it stops changing, so a rate read
    # from the last two points falls to 0), or when that one is this many seconds old (tiers.py).
    resend_unchanged_s: ClassVar[float | None] = None
    # "": the source's rounds run in worker threads of its own (one per tier). A name: every source
    # with that name shares one worker thread per tier, its rounds of a tier run one after the other
    # there; for sources whose rounds never block (eBPF map reads), where waking a thread per source
    # costs more than the reads (tiers.py).
    worker: ClassVar[str] = ""

    def setup(self) -> None:
        """Raise Unavailable(reason) when this source cannot run here."""

    def collect(self, tier: str) -> list[Sample]:
        raise NotImplementedError

    def events(self) -> list[Event]:
        """Events that happened since the last call (XID errors, health changes). Default: none."""
        return []

    def inventory(self) -> list[dict]:
        """Resources in the inventory schema of DESIGN.md this source found. Default: none."""
        return []

    def describe(self) -> dict:
        """Extra facts for `xpusense-agent sources` (attach points, devices, missing metrics)."""
        return {}

    # Optional abilities: the defaults say "none"; accelerator sources override them.
    def processes(self) -> dict[int, set[str]]:
        """pid -> ids of the accelerators it uses (read when the HBM watch fires)."""
        return {}

    def hbm_watch_coverage(self) -> dict[str, str]:
        """device id -> why the HBM watch cannot follow it ("" when it can)."""
        return {}

    def close(self) -> None:
        """Release what setup() took."""


@dataclasses.dataclass(frozen=True)
class SourceFamily:
    """One `[sources.NAME]` config table: its keys, declared beside the code that reads them, and how
    its sources are built from the checked table. Every source module exports one as `FAMILY`;
    agent/sources/registry.py lists them, and the agent's config schema and daemon loop over that list.
    """

    name: str
    schema: dict[str, Any]                  # xpusense.common.config Keys; must include "enabled"
    build: Callable[[Any], list[Source]]    # the checked table (a namespace) -> sources


def stamp(samples: Iterable[Sample], time_ns: int | None = None) -> list[Sample]:
    """Give every sample without a timestamp the same one (one instant per round)."""
    now = time.time_ns() if time_ns is None else time_ns
    out = []
    for s in samples:
        if not s.time_ns:
            s.time_ns = now
        out.append(s)
    return out
