"""What the scheduler reads from a node's inventory besides its labels: memory sizes, the price label,
each accelerator's interconnect domain, and its model's peak TFLOPS (config, then the catalog).

Memory sizes: inventory attributes say "80GB" for 80 GiB (NVML and npu-smi sizes divided by 2^30),
so "GB" is read as 2^30 bytes here and in requests alike.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from xpusense.common import catalog

log = logging.getLogger("xpusense.collector.scheduler")

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'80GB' / '64 GiB' / '32768MB' / '1073741824' -> bytes; GB means 2^30 as in the inventory."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 40GB, 64GiB, 32768MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory(attributes: Any) -> float:
    """An accelerator's HBM in bytes from its `memory` attribute; 0 when absent or unreadable."""
    text = attributes.get("memory", "")
    try:
        return float(parse_memory(text)) if text else 0.0
    except ValueError:
        return 0.0


def price(text: str) -> float | None:
    """The `price` label (per accelerator-hour; the first number in it), None when absent or 0."""
    m = re.search(r"[0-9]+(?:\.[0-9]+)?", text or "")
    p = float(m.group()) if m else 0.0
    return p if p > 0 else None


def interconnect_domain(res: Any, rtype: str) -> str:
    """The NVLink/HCCS domain an accelerator (inventory Resource) is in; devices of one domain can
    be given to one job with same_domain. A device without NVLink or HCCS is a domain of its own."""
    attrs = res.attributes
    if attrs.get("interconnect_domain"):
        return attrs["interconnect_domain"]
    kinds = {ic.type.lower() for ic in res.interconnects}
    if rtype == "GPU" and kinds & {"nvlink", "nvswitch"} and attrs.get("nvlink_count", "1") != "0":
        return "nvlink"
    if "hccs" in kinds:
        if res.model.startswith("Ascend-910A"):
            # Atlas 800 (9000/9010): NPUs 0-3 and 4-7 form two HCCS full-mesh groups
            # (common/catalog/huawei.toml).
            m = re.match(r"npu(\d+)", res.id)
            return f"hccs{int(m.group(1)) // 4}" if m else "hccs"
        return "hccs"
    return f"pcie:{res.id}"


class PeakTflops:
    """Peak dense FP16 TFLOPS of an accelerator model: the operator's [scheduler.peak_tflops] first,
    then the catalog of the device's vendor (xpusense.common.catalog; every vendor's, in turn, when
    the inventory names a vendor the catalog does not have). None when neither gives a figure: its
    value per price then counts as unknown. A broken catalog file is logged once per vendor and
    read as giving no figures, so that the collector keeps serving."""

    def __init__(self, configured: dict[str, float]):
        self.configured = configured
        self._cache: dict[tuple[str, str], float | None] = {}
        self._reported: set[str] = set()

    def __call__(self, vendor: str, model: str) -> float | None:
        key = (vendor, model)
        if key in self._cache:
            return self._cache[key]
        tflops = self.configured.get(model)
        if tflops is None:
            vendor = vendor.lower()
            for v in (vendor,) if vendor in catalog.VENDORS else catalog.VENDORS:
                tflops = self._from_catalog(v, model)
                if tflops is not None:
                    break
        self._cache[key] = tflops
        return tflops

    def _from_catalog(self, vendor: str, model: str) -> float | None:
        try:
            return catalog.peak_tflops(vendor, model)
        except catalog.CatalogError as e:
            if vendor not in self._reported:
                self._reported.add(vendor)
                log.error("scheduler: %s; peak TFLOPS of %s models count as unknown", e, vendor)
            return None
