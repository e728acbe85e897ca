"""Static facts about accelerator models that the vendor tools do not report, from the catalog files.

One loader for the agent's NVML and npu-smi sources and the collector's scheduler: the files are
`common/catalog/<vendor>.toml`, shipped inside the package (data, each figure with its source). A
file that is missing or does not parse is a broken installation, so `load()` raises CatalogError
naming the file, and the caller reports it once.
"""

from __future__ import annotations

import functools
import re
import tomllib
from importlib import resources
from typing import Any

VENDORS = ("nvidia", "huawei")


class CatalogError(Exception):
    """A catalog file is missing or malformed; the message names the file."""


@functools.cache
def load(vendor: str) -> dict[str, Any]:
    """The parsed catalog of one vendor (`nvidia` or `huawei`), read once per process."""
    if vendor not in VENDORS:
        raise CatalogError(f"no catalog for vendor {vendor!r} (known: {', '.join(VENDORS)})")
    where = resources.files("xpusense.common").joinpath(f"catalog/{vendor}.toml")
    try:
        with where.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise CatalogError(f"catalog {where} unreadable: {e.strerror or e} (reinstall xpusense)") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"catalog {where} is not valid TOML: {e}") from None
    table = "gpu" if vendor == "nvidia" else "models"
    entries = data.get(table)
    if not isinstance(entries, (list, dict)):
        raise CatalogError(f"catalog {where}: no [{'[gpu]' if table == 'gpu' else 'models'}] entries")
    return data


def _spaced(name: str) -> str:
    return name.replace("-", " ")


def nvidia_gpu(name: str) -> dict[str, Any]:
    """The first `[[gpu]]` entry whose `match` is in the NVML device name or inventory model
    ("NVIDIA H100 PCIe", "H100-SXM5-80GB"), or {} when the catalog does not know the model."""
    spaced = _spaced(name)
    return next((e for e in load("nvidia")["gpu"] if _spaced(e.get("match", "\0")) in spaced), {})


def nvlink_generation(arch: int | None) -> dict[str, Any]:
    """NVML architecture id -> {generation, per_link_gbs}, or {} when unknown."""
    return load("nvidia").get("nvlink", {}).get("generation", {}).get(str(arch), {})


def huawei_model(model: str) -> dict[str, Any]:
    """The `[models."Ascend-910B4"]` entry of an inventory model; a board variant ("Ascend-910B4-1")
    falls back to its chip's entry; {} when the catalog does not know the model."""
    models = {_key(k): v for k, v in load("huawei")["models"].items() if isinstance(v, dict)}
    key = _key(model)
    return models.get(key) or models.get(re.sub(r"-[0-9]+$", "", key), {})


def _key(model: str) -> str:
    return re.sub(r"\s+", "", model).lower()


def peak_tflops(vendor: str, model: str) -> float | None:
    """Dense FP16/BF16 peak TFLOPS of a model from the catalog, None where no source gives one."""
    entry = nvidia_gpu(model) if vendor == "nvidia" else huawei_model(model)
    value = entry.get("peak_tflops")
    return float(value) if value else None
