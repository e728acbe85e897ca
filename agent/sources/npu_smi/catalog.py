"""NPU inventory: chip names -> inventory models, the static facts of the Huawei catalog, resources.

npu-smi does not print cube units or HCCS bandwidth; they come from the Huawei catalog file
(common/catalog/huawei.toml, read by xpusense.common.catalog).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from xpusense.common import catalog as common_catalog

from .table import InfoTable
from .values import VENDOR

log = logging.getLogger("xpusense.agent.sources.npu_smi")


def normalize_model(name: str) -> str:
    """Chip name as npu-smi prints it -> inventory model: "910B4" / "Ascend 910A" / "Ascend910" -> "Ascend-910B4"..."""
    n = re.sub(r"(?i)^ascend[\s_-]*", "", name.strip())
    n = re.sub(r"\s+", "", n)
    return f"Ascend-{n}" if n else "Ascend"


def informative(name: str | None) -> bool:
    """A chip name that says which chip it is (has a digit; public captures often redact it to "xxx")."""
    return bool(name) and bool(re.search(r"[0-9]", name or ""))


def memory_text(mb: float) -> str:
    gb = mb / 1024.0
    return f"{round(gb)}GB" if abs(gb - round(gb)) < 0.05 else f"{gb:.1f}GB"


def _interconnects(entry: Mapping) -> list[dict[str, str]]:
    return [{"type": str(ic["type"]), **({"bandwidth": str(ic["bandwidth"])} if "bandwidth" in ic else {})}
            for ic in entry.get("interconnects", []) if isinstance(ic, dict) and "type" in ic]


def inventory_resources(table: InfoTable, names: Mapping[str, str] | None = None) -> list[dict]:
    """One NPU resource per chip in DESIGN.md's inventory schema.

    `names` (device -> chip name, e.g. from `npu-smi info -m`) is used where the table's Name says
    nothing (redacted or blank). Catalog fields a model does not have are left out.
    """
    names = names or {}
    per_card: dict[int, int] = {}
    for c in table.chips:
        per_card[c.npu_id] = per_card.get(c.npu_id, 0) + 1
    resources = []
    for c in table.chips:
        name = c.name if informative(c.name) else (names.get(c.device) or c.name)
        model = normalize_model(name)
        entry = common_catalog.huawei_model(model)
        attrs: dict[str, str] = {}
        total = c.hbm_total_mb or c.memory_total_mb
        if total:
            attrs["memory"] = memory_text(total)
        attrs["chips_per_card"] = str(per_card[c.npu_id])
        if c.bus_id:
            attrs["pci_bus_id"] = c.bus_id
        if table.driver_version:
            attrs["driver_version"] = table.driver_version
        for k in ("matrix_units", "matrix_unit_shape", "vector_units"):
            if k in entry:
                attrs[k] = str(entry[k])
        resources.append({"type": "NPU", "vendor": VENDOR, "model": model, "id": c.device,
                          "attributes": attrs, "interconnects": _interconnects(entry)})
    return resources
