"""Loading NVML through pynvml (nvidia-ml-py) and what its answers mean.

pynvml raises `NVMLError` subclasses carrying the NVML return code in `.value`; nothing here keeps
state: the rest of the package passes the loaded module (`nv`) around.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

from ..base import Unavailable


def load() -> Any:
    """Import pynvml and call nvmlInit; raise Unavailable with what to do when that fails."""
    try:
        nv = importlib.import_module("pynvml")
    except ImportError as e:
        raise Unavailable(f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py") from e
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        c = code(e)
        if c == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
            raise Unavailable("libnvidia-ml.so.1 not found: no NVIDIA driver on this host "
                              "(install the driver, or put the library on LD_LIBRARY_PATH)") from None
        if c == nv.NVML_ERROR_DRIVER_NOT_LOADED:
            raise Unavailable("the NVIDIA kernel driver is not loaded (modprobe nvidia; check dmesg)") from None
        if c == nv.NVML_ERROR_NO_PERMISSION:
            raise Unavailable("no permission to open the NVIDIA devices (/dev/nvidia*)") from None
        raise Unavailable(f"nvmlInit failed: {e}") from None
    return nv


def code(e: BaseException) -> int | None:
    """The NVML return code of a pynvml error (None for anything else)."""
    v = getattr(e, "value", None)
    return v if isinstance(v, int) else None


def text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def handle_key(handle: Any) -> int:
    """A hashable identity for an NVML device handle (a ctypes pointer)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
