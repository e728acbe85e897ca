"""Samples made from the per-NPU key-value outputs (`npu-smi info -t usages|common|power|temp|health -i N`).

Metric names and units are those of docs/metrics.md; every sample is labelled with its chip
(`device`, see values.device_id) and `vendor`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..base import Sample
from .kv import KvOutput, KvRecord, chip_records
from .values import MIB, FieldError, device_id, device_labels, is_missing, norm_key, parse_number

HBM_BANDWIDTH = "xpusense.accelerator.hbm.bandwidth.utilization"
CLOCK_FREQUENCY = "xpusense.accelerator.clock.frequency"
MHZ = 1_000_000
MAX_CLOCK_MHZ = 100_000   # a printed AI Core clock above this is garbage, not a frequency

# Field names per metric, in order of preference (compared as norm_key). Data, not code.
USAGE_RATIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hw.gpu.utilization", ("Aicore Usage Rate(%)",)),
    ("xpusense.accelerator.vector.utilization", ("Aivector Usage Rate(%)", "Vector Core Usage Rate(%)")),
    ("xpusense.accelerator.cube.utilization", ("Aicube Usage Rate(%)", "Cube Usage Rate(%)")),
    (HBM_BANDWIDTH, ("HBM Bandwidth Usage Rate(%)",)),
)
# `-t common`: label `clock` -> field names. The rest of its output (usage rates, temperature, power)
# is read from `-t usages`, `-t temp` and `-t power` already.
AICORE_CLOCK_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("aicore", ("Aicore curFreq(MHZ)", "Aicore Current Freq(MHZ)")),
    ("aicore_rated", ("Aicore Freq(MHZ)", "Aicore Rated Freq(MHZ)")),
)
POWER_KEYS = ("NPU Real-time Power(W)", "Real-time Power(W)", "Power Dissipation(W)", "Power(W)")
CHIP_TEMP_KEYS = ("NPU Temperature (C)", "Chip Temperature(C)", "Temperature(C)")
HBM_TEMP_KEYS = ("HBM Temperature (C)", "HBM Temperature(C)")
HEALTH_KEYS = ("Health Status", "Health")


def usages_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t usages -i N` -> utilisation ratios, HBM bandwidth, HBM used/total/ratio.

    HBM used is `HBM Capacity(MB)` x `HBM Usage Rate(%)` (the output has no used figure, so it is
    as coarse as the integer percentage). A chip without HBM (310, 310P) reports its DDR instead.
    """
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        labels = device_labels(npu, chip)
        for metric, keys in USAGE_RATIOS:
            v = rec.number(*keys)
            if v is not None:
                samples.append(Sample(metric, v / 100.0, "1", dict(labels)))
        cap, rate = rec.number("HBM Capacity(MB)"), rec.number("HBM Usage Rate(%)")
        if not cap:
            ddr_cap = rec.number("DDR Capacity(MB)")
            if ddr_cap:
                cap, rate = ddr_cap, rec.number("DDR Usage Rate(%)")
        if cap:
            samples.append(Sample("hw.gpu.memory.limit", cap * MIB, "By", dict(labels)))
            if rate is not None:
                used = float(round(cap * MIB * rate / 100.0))
                samples.append(Sample("hw.gpu.memory.utilization", rate / 100.0, "1", dict(labels)))
                samples.append(Sample("hw.gpu.memory.usage", used, "By", dict(labels)))
    return samples


def _printed(rec: KvRecord, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(key as printed, value) of the first of `names` the record has (names compared as norm_key)."""
    for n in names:
        for k, v in rec.fields.items():
            if norm_key(k) == norm_key(n):
                return k, v
    return None


def common_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = (),
                   command: str = "npu-smi info -t common") -> list[Sample]:
    """`npu-smi info -t common -i N` -> xpusense.accelerator.clock.frequency (Hz) per chip, label
    `clock` = `aicore` (`Aicore curFreq(MHZ)`, the AI Core's current clock) and `aicore_rated`
    (`Aicore Freq(MHZ)`, its rated clock).

    A field that is absent or NA (a model or driver without it) gives no sample; one printed with a
    value that is not a frequency raises FieldError naming the field, with the samples of every
    other field and chip in `.partial`.
    """
    samples: list[Sample] = []
    bad: FieldError | None = None
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        labels = device_labels(npu, chip)
        for clock, keys in AICORE_CLOCK_KEYS:
            found = _printed(rec, keys)
            if found is None or is_missing(found[1]):
                continue
            key, text = found
            mhz = parse_number(text)
            if mhz is None or not 0 <= mhz <= MAX_CLOCK_MHZ:
                why = "is not a number" if mhz is None else f"is out of range (0..{MAX_CLOCK_MHZ} MHz)"
                bad = bad or FieldError(command, key, text, None, f"of {device_id(npu, chip)} {why}")
                continue
            samples.append(Sample(CLOCK_FREQUENCY, mhz * MHZ, "Hz", {**labels, "clock": clock}))
    if bad is not None:
        bad.partial = samples
        raise bad
    return samples


def power_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t power -i N` -> hw.power (W) per chip."""
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        v = rec.number(*POWER_KEYS)
        if v is not None:
            samples.append(Sample("hw.power", v, "W", device_labels(npu, chip)))
    return samples


def temp_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t temp -i N` -> hw.temperature (Cel), sensor chip / hbm (board MCU sensors left out)."""
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        for sensor, keys in (("chip", CHIP_TEMP_KEYS), ("hbm", HBM_TEMP_KEYS)):
            v = rec.number(*keys)
            if v is not None:
                samples.append(Sample("hw.temperature", v, "Cel", {**device_labels(npu, chip), "sensor": sensor}))
    return samples


@dataclasses.dataclass
class HealthReading:
    npu_id: int
    chip_id: int
    status: str                 # OK, Warning, Alarm, Critical, UNKNOWN (as printed)
    error_codes: str = ""       # "A4025021 8C03A000 8C084E00", "" for NA
    error_information: str = ""  # whole, several lines joined with newlines

    @property
    def device(self) -> str:
        return device_id(self.npu_id, self.chip_id)

    @property
    def ok(self) -> bool:
        return self.status.strip().upper() == "OK"


def health_readings(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[HealthReading]:
    """`npu-smi info -t health -i N` -> one reading per chip.

    The output of one NPU may carry no Chip ID at all; when the NPU has several chips and the output
    one record, that record is the card's health and is given to every chip.
    """
    known = list(known_chips)
    records = chip_records(out, npu_id, known)
    readings = []
    if len(records) == 1 and records[0][2].chip_id is None and len(known) > 1:
        npu, _, rec = records[0]
        records = [(npu, c, rec) for c in known]
    for npu, chip, rec in records:
        status = rec.get(*HEALTH_KEYS)
        if status is None or not status.strip():
            continue
        codes = rec.get("Error Code") or ""
        info = rec.get("Error Information") or ""
        readings.append(HealthReading(npu, chip, status.strip(),
                                      "" if is_missing(codes) else " ".join(codes.split()),
                                      "" if is_missing(info) else info.strip()))
    return readings


def health_samples(readings: Iterable[HealthReading]) -> list[Sample]:
    """xpusense.accelerator.health: 1 when OK, 0 otherwise, with the printed status as label `status`."""
    return [Sample("xpusense.accelerator.health", 1.0 if r.ok else 0.0, "1",
                   {**device_labels(r.npu_id, r.chip_id), "status": r.status}) for r in readings]


def severity_of(status: str) -> str:
    """The Event severity of a printed health status."""
    s = status.strip().upper()
    if s == "OK":
        return "info"
    if s == "WARNING":
        return "warning"
    return "critical"  # Alarm, Critical, UNKNOWN, anything else
