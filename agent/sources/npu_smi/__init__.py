"""Huawei Ascend NPU utilisation, HBM, power, temperature and health, read from the `npu-smi` tool.

npu-smi is slow and forks a process per call, so this source budgets it: the realtime tier runs
`npu-smi info -t usages -i N` for every NPU at once (a thread pool, one subprocess each, argv
lists, never a shell) under one deadline; calls still running at the deadline are killed, their
NPUs are left out of that round and the round is counted as skipped (never queued behind). The
offline tier reads power, temperatures and health the same way, and turns a chip's change of
health into an Event.

Parsing is separate from reading, and text that is not understood raises `ParseError` naming the
command and the first line it could not read, with what could be read in `.partial`. Modules, each
importing only those above it:

- values.py: key and id spelling, printed numbers and `used / total` pairs, ParseError.
- kv.py: `parse_kv()`, the `-t TYPE -i N`, `-l` and `-m` outputs (keys by name).
- readings.py: Samples (named as in docs/metrics.md) and health readings from the `-t` outputs.
- table.py: `parse_info()`, the `npu-smi info` table (columns found from its header rows, never
  from fixed offsets).
- catalog.py: inventory resources; static facts npu-smi does not print (cube units, HCCS
  bandwidth) come from the Huawei catalog (common/catalog/huawei.toml).
- runner.py: running npu-smi, alone or a round of calls at once under one deadline.
- source.py: `NpuSmiSource` and its `[sources.npu_smi]` config table (`FAMILY`).
"""
