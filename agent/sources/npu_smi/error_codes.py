"""npu-smi's error codes (`Error Code` of `npu-smi info -t health -i N`) as series: a counter per
chip and code that counts each time a code appears in the chip's list when the reading before did
not list it (the codes listed at the agent's first reading count once), and npu-exporter's
`npu_chip_info_error_code`: the first code listed now as a number (0 when none)."""

from __future__ import annotations

import re

from xpusense.common import metric_names as m

from ..base import Sample
from ..code_counts import OTHER, CodeCounts
from .readings import HealthReading
from .values import device_labels

HEX_CODE = re.compile(r"[0-9A-Fa-f]{1,8}")   # npu-smi prints 32-bit codes in hex: A4025021


class ErrorCodes:
    def __init__(self, codes_per_device: int):
        self.counts = CodeCounts(m.NPU_ERROR_CODES, "code", codes_per_device)
        self._listed: dict[str, set[str]] = {}   # chip -> the codes its last health reading listed

    def saw(self, readings: list[HealthReading]) -> None:
        """Count the codes each reading lists that the chip's reading before did not."""
        for r in readings:
            codes = [code(c) for c in r.error_codes.split()]
            before = self._listed.get(r.device, set())
            labels = device_labels(r.npu_id, r.chip_id)
            for c in dict.fromkeys(codes):
                if c not in before:
                    self.counts.add(labels, c)
            self._listed[r.device] = set(codes)

    def samples(self, readings: list[HealthReading]) -> list[Sample]:
        """The counters, and the first code each reading lists now (0 when none)."""
        out = self.counts.samples()
        for r in readings:
            first = next(iter(r.error_codes.split()), "")
            if first and not HEX_CODE.fullmatch(first):
                continue   # not a code npu-exporter could show as a number: no gauge for the chip
            out.append(Sample(m.NPU_ERROR_CODE, float(int(first, 16)) if first else 0.0, "{code}",
                              device_labels(r.npu_id, r.chip_id)))
        return out


def code(text: str) -> str:
    """A listed code as its label value: upper-case hex (`A4025021`); anything else printed in the
    list is not a code npu-smi writes and counts as `other`."""
    return text.upper() if HEX_CODE.fullmatch(text) else OTHER
