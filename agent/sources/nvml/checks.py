"""What may leave the NVML source: every sample is checked before it goes, as DCGM blanks bad values.

Drivers answer NaN with a success code (GPM), 0 or garbage for sensors they do not really have
(HBM temperature on some parts, nvbug 4300930; DCGM also rejects memory temperatures above 200 C),
and all-ones for unavailable counters. A NaN that reached the HBM watch would compare as "not below
the threshold" and send checkpoint requests, so nothing that fails these rules is sent: it is dropped,
counted, and said once per series in the log and in `describe()`.
"""

from __future__ import annotations

import logging
import math

from ..base import Sample

log = logging.getLogger("xpusense.agent.nvml")

MAX_TEMPERATURE_C = 200.0    # DCGM's limit for memory temperature; no GPU sensor reads above it
MIN_TEMPERATURE_C = -40.0
MAX_POWER_W = 10_000.0       # no GPU board draws 10 kW (GB200 superchip: 2.7 kW); all-ones mW is 4.3 MW


def problem(s: Sample) -> str | None:
    """Why a sample may not leave the source, or None when it may."""
    v = s.value
    if not math.isfinite(v):
        return f"{v!r} is not a number"
    if s.unit == "1" and not 0.0 <= v <= 1.0:
        return f"{v:g} is not a ratio between 0 and 1"
    if s.unit == "Cel":
        if s.labels.get("sensor") == "hbm" and v <= 0.0:
            return f"{v:g} C: the driver reports 0 or less for a memory sensor it does not read (nvbug 4300930)"
        if not MIN_TEMPERATURE_C <= v <= MAX_TEMPERATURE_C:
            return f"{v:g} C is outside {MIN_TEMPERATURE_C:g}..{MAX_TEMPERATURE_C:g} C"
        return None
    if s.unit == "W" and v > MAX_POWER_W:
        return f"{v:g} W is more than any GPU draws"
    if v < 0.0:
        return f"{v:g} is negative"
    return None


class Gate:
    """Drops the samples that fail `problem`, counting them per series for `describe()`."""

    def __init__(self) -> None:
        self.dropped: dict[str, tuple[int, str]] = {}   # series -> (count, last reason)

    def admit(self, samples: list[Sample]) -> list[Sample]:
        out = []
        for s in samples:
            why = problem(s)
            if why is None:
                out.append(s)
                continue
            key = series_key(s)
            n = self.dropped.get(key, (0, ""))[0] + 1
            self.dropped[key] = (n, why)
            if n == 1:
                log.warning("NVML value dropped, %s: %s (said once per series)", key, why)
        return out

    def describe(self) -> dict[str, str]:
        return {k: f"{why} ({n} dropped)" for k, (n, why) in sorted(self.dropped.items())}


def series_key(s: Sample) -> str:
    extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("device", "vendor"))
    return f"{s.labels.get('device', '?')}/{s.name}" + (f"{{{extra}}}" if extra else "")
