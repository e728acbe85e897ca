"""Huawei Ascend NPU utilisation, HBM, power, temperature and health, read from the `npu-smi` tool.

Modules, each importing only those above it: values.py (key and id spelling, printed numbers,
ParseError), cells.py and table.py (the `npu-smi info` table), kv.py (the `-t TYPE -i N`, `-l`, `-m`
outputs), readings.py (Samples and health from the `-t` outputs), catalog.py (inventory resources),
runner.py (calls under one deadline; npu-smi is slow and forks a process per call), source.py
(NpuSmiSource and its `[sources.npu_smi]` config table)."""
