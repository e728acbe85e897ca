"""Error codes counted per device (NVML XIDs, npu-smi error codes): a counter per device and code
since the agent started, with the last code seen. At most `max_codes` codes per device are
series of their own; an occurrence of any further code is counted under code `other` and in
`xpusense.accelerator.error_codes.over_limit`, so no occurrence is lost from a device's total."""

from __future__ import annotations

import threading

from .base import COUNTER, Sample

OTHER = "other"
OVER_LIMIT = "xpusense.accelerator.error_codes.over_limit"


class CodeCounts:
    """Thread-safe: the NVML event thread adds while the rounds read."""

    def __init__(self, metric: str, label: str, max_codes: int):
        if max_codes < 1:
            raise ValueError(f"max_codes must be at least 1, not {max_codes}")
        self.metric = metric
        self.label = label
        self.max_codes = max_codes
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}     # device -> code (or OTHER) -> occurrences
        self._labels: dict[str, dict[str, str]] = {}     # device -> its labels
        self._last: dict[str, str] = {}                  # device -> the last code added
        self._over: dict[str, int] = {}                  # device -> occurrences counted under OTHER

    def add(self, labels: dict[str, str], code: str, n: int = 1) -> None:
        """Count `n` occurrences of `code` on the device of `labels` (its `device` label)."""
        dev = labels["device"]
        with self._lock:
            counts = self._counts.setdefault(dev, {})
            self._labels.setdefault(dev, dict(labels))
            self._last[dev] = code
            own = len(counts) - (OTHER in counts)
            if code not in counts and code != OTHER and own >= self.max_codes:
                self._over[dev] = self._over.get(dev, 0) + n
                code = OTHER
            counts[code] = counts.get(code, 0) + n

    def last(self, device: str) -> str | None:
        with self._lock:
            return self._last.get(device)

    def samples(self) -> list[Sample]:
        """The counters of every device with a count, and the over-limit counter where it was hit."""
        with self._lock:
            out = [Sample(self.metric, float(n), "{error}", {**self._labels[dev], self.label: code}, COUNTER)
                   for dev, counts in self._counts.items() for code, n in counts.items()]
            out += [Sample(OVER_LIMIT, float(n), "{error}", dict(self._labels[dev]), COUNTER)
                    for dev, n in self._over.items()]
        return out
