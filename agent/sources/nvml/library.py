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


def has_function(nv: Any, name: str) -> bool:
    """Whether the loaded library exports `name` (older drivers lack the newer calls)."""
    try:
        nv._nvmlGetFunctionPointer(name)
        return True
    except nv.NVMLError:
        return False


def handle_key(handle: Any) -> int:
    """A hashable identity for an NVML device handle (a ctypes pointer)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


# NVML return codes (nvml.h nvmlReturn_t; the values never change between driver releases).
UNSUPPORTED_CODES = {
    2: "INVALID_ARGUMENT", 3: "NOT_SUPPORTED", 4: "NO_PERMISSION", 6: "NOT_FOUND", 13: "FUNCTION_NOT_FOUND",
    22: "VGPU_ECC_NOT_SUPPORTED", 24: "FREQ_NOT_SUPPORTED", 25: "ARGUMENT_VERSION_MISMATCH", 26: "DEPRECATED",
}
SUCCESS = 0
GPU_IS_LOST, RESET_REQUIRED, NO_PERMISSION, FUNCTION_NOT_FOUND, TIMEOUT = 15, 16, 4, 13, 10

# What an error says about a reading (DCGM's cache manager and gpud draw the same lines):
UNSUPPORTED = "unsupported"   # this GPU, driver or agent cannot answer it: stop asking, say why once
TRANSIENT = "transient"       # Unknown, Timeout, NotReady, InUse, NoData...: no value now, ask again later
RESET = "reset_required"      # the GPU needs a reset: a health event, and ask again later
LOST = "lost"                 # the GPU fell off the bus: a health event, the GPU is left out


class Unreadable(Exception):
    """An answer with a success code that cannot be read (an unknown value type): not supported here."""


def classify(rc: int | None) -> str:
    """What an NVML return code means for the reading that got it."""
    if rc == GPU_IS_LOST:
        return LOST
    if rc == RESET_REQUIRED:
        return RESET
    if rc in UNSUPPORTED_CODES:
        return UNSUPPORTED
    return TRANSIENT


def error_text(nv: Any, rc: int) -> str:
    """'Unknown Error (999)': the library's text for a code returned in a struct, not raised."""
    try:
        return f"{nv.nvmlErrorString(rc)} ({rc})"
    except Exception:  # the library is gone or does not know the code
        return f"NVML error {rc}"
