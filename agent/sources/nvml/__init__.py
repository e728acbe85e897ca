"""NVIDIA GPUs through NVML (nvidia-ml-py): utilisation, HBM bandwidth (GPM), memory, NVLink, PCIe,
clocks, processes, power, energy, temperatures, throttling, ECC, XID events and inventory.

pynvml finds `libnvidia-ml.so.1` through the dynamic loader, so a test puts a fake one on
LD_LIBRARY_PATH (tests/fakes/nvml) and pynvml's own ctypes code runs. Modules, upstream first:
library (loading NVML, what its errors mean), device (what is kept per GPU), readings (the simple
readings as data), gpm (HBM bandwidth and other GPM metrics), events (the XID/ECC event thread),
inventory (discovery and catalog facts), source (`NvmlSource`, its config keys and `FAMILY`).
"""
