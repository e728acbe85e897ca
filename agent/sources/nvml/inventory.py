"""What each GPU is: identity from NVML, static facts from the catalog (common/catalog/nvidia.toml),
and the inventory entries of DESIGN.md's schema."""

from __future__ import annotations

from typing import Any

from xpusense.common import catalog

from .device import VENDOR, Gpu
from .library import text


def model_name(nvml_name: str) -> str:
    """'NVIDIA A100-SXM4-40GB' -> 'A100-SXM4-40GB' (the inventory schema's style)."""
    name = nvml_name.removeprefix("NVIDIA ").strip()
    return "-".join(name.split())


def nvlink_bandwidth(arch: int | None, links: int) -> str:
    gen = catalog.nvlink_generation(arch)
    if not gen or not links:
        return ""
    return f"{links * gen['per_link_gbs']}GB/s"


def identify(nv: Any, g: Gpu, driver: str) -> None:
    """Name, UUID and bus id: what a GPU must answer to be reported at all (the rest is optional:
    with MIG on and no monitor capability even the memory size is refused)."""
    h = g.handle
    g.name = text(nv.nvmlDeviceGetName(h))
    g.info["product"] = "-".join(g.name.split())   # NVML's name, as GPU feature discovery labels it
    g.info["uuid"] = text(nv.nvmlDeviceGetUUID(h))
    g.info["pci_bus_id"] = text(nv.nvmlDeviceGetPciInfo(h).busId)
    g.info["driver"] = driver


GA100 = ("A100", "A800", "A30")   # GA100 boards: Ampere, but instantaneous power like older GPUs
AMPERE = 7                         # NVML_DEVICE_ARCH_AMPERE


def power_reading(name: str, arch: int | None) -> str:
    """What nvmlDeviceGetPowerUsage means on this GPU (nvml.h): averaged over 1 s on Ampere (except
    GA100) and newer, instantaneous on GA100 and older architectures."""
    if arch is None:
        return ""
    if arch < AMPERE or (arch == AMPERE and any(m in name for m in GA100)):
        return "instantaneous"
    return "1s_average"


def catalog_facts(g: Gpu) -> None:
    g.info["power_reading"] = power_reading(g.name, g.arch)
    entry = catalog.nvidia_gpu(g.name)
    g.peak_tflops = float(entry.get("peak_tflops", 0.0))
    if entry.get("architecture"):
        g.info["architecture"] = str(entry["architecture"])


def count_nvlinks(nv: Any, g: Gpu) -> int:
    active = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            if nv.nvmlDeviceGetNvLinkState(g.handle, link) == nv.NVML_FEATURE_ENABLED:
                active += 1
        except nv.NVMLError:
            break  # NotSupported / InvalidArgument past the last link
    return active


def entry(g: Gpu) -> dict[str, Any]:
    attrs = {k: v for k, v in g.info.items() if v}
    bw = nvlink_bandwidth(g.arch, g.nvlinks)
    return {"type": "GPU", "vendor": VENDOR, "model": model_name(g.name), "id": g.id, "attributes": attrs,
            "interconnects": [{"type": "NVLink", "bandwidth": bw}] if bw else []}
