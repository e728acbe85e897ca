"""The one interface every source of measurements has (host, NVML, npu-smi, eBPF probes).

`setup()` finds out whether the source can run here and raises `Unavailable` with a reason a person
can act on; `collect(tier)` returns samples for one tier; `close()` releases what setup took.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar, Iterable

REALTIME, NEARLINE, OFFLINE = "realtime", "nearline", "offline"
TIERS = (REALTIME, NEARLINE, OFFLINE)

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"


class Unavailable(Exception):
    """This source cannot run on this host; the message says why and what to do about it."""


class SourceError(Exception):
    """A round of a source failed (bad tool output, a vanished device); the next round may work.

    `samples` holds what the round could still read: it is kept, and the error is reported.
    """

    def __init__(self, message: str, samples: "list[Sample] | None" = None):
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

    def close(self) -> None:
        """Release what setup() took."""


def stamp(samples: Iterable[Sample], time_ns: int | None = None) -> list[Sample]:
    """Give every sample without a timestamp the same one (one instant per round)."""
    now = time.time_ns() if time_ns is None else time_ns
    out = []
    for s in samples:
        if not s.time_ns:
            s.time_ns = now
        out.append(s)
    return out
