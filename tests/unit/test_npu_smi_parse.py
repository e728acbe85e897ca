"""npu-smi parsers and converters over every recorded sample in tests/fixtures/npu-smi, plus fuzzing.

Each recorded sample has its exact values checked here; a new recorded file without a test fails
test_every_recorded_sample_is_checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpusense.agent.sources.npu_smi.catalog import inventory_resources, normalize_model
from xpusense.agent.sources.npu_smi.kv import KvOutput, chip_records, parse_kv
from xpusense.agent.sources.npu_smi.readings import (
    common_samples,
    health_readings,
    health_samples,
    power_samples,
    temp_samples,
    usages_samples,
)
from xpusense.agent.sources.npu_smi.source import NpuSmiSource
from xpusense.agent.sources.npu_smi.table import parse_info
from xpusense.agent.sources.npu_smi.values import MIB, FieldError, ParseError
from xpusense.common import catalog as common_catalog

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "npu-smi"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "npu-smi"
RECORDED = sorted(p.name for p in FIXTURES.glob("*.txt") if not p.name.endswith(".source.txt"))


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text()


def by_name(samples, device=None):
    """{(metric, sensor-or-status...): value} for one device."""
    out = {}
    for s in samples:
        if device is not None and s.labels.get("device") != device:
            continue
        extra = tuple(v for k, v in sorted(s.labels.items()) if k not in ("device", "vendor"))
        out[(s.name, *extra)] = s.value
    return out


# -- the recorded samples -----------------------------------------------------------------------

def test_every_recorded_sample_is_checked():
    names = {n for n in RECORDED}
    expected = {
        "info-910A-2.txt", "info-910B4-1.txt", "info-l-910B-1.txt", "info-m-910A-1.txt",
        "info-t-board-910B-1.txt", "info-t-common-910B-1.txt", "info-t-health-910A-2.txt",
        "info-t-power-910B-1.txt", "info-t-temp-910B-1.txt", "info-t-usages-910A-1.txt",
        "info-t-usages-910B-2.txt",
    }
    assert names == expected, "a recorded sample was added or removed: give it a test with its values"
    for n in names:
        assert (FIXTURES / n.replace(".txt", ".source.txt")).is_file(), f"{n} has no .source.txt"


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared fixtures folder is not next to this checkout")
def test_fixtures_are_byte_for_byte_copies():
    for p in sorted(SHARED.iterdir()):
        assert (FIXTURES / p.name).read_bytes() == p.read_bytes(), p.name


def test_info_910B4_table():
    t = parse_info(recorded("info-910B4-1.txt"))
    assert (t.tool_version, t.driver_version) == ("25.0.rc1.1", "25.0.rc1.1")
    assert [c.device for c in t.chips] == [f"npu{n}-0" for n in range(8)]
    assert {c.name for c in t.chips} == {"910B4"} and {c.health for c in t.chips} == {"OK"}
    assert [c.power_w for c in t.chips] == [87.2, 82.7, 82.7, 89.1, 84.5, 84.8, 87.1, 81.6]
    assert [c.temp_c for c in t.chips] == [33, 33, 33, 34, 39, 37, 38, 37]
    assert [c.bus_id for c in t.chips] == ["0000:C1:00.0", "0000:C2:00.0", "0000:81:00.0", "0000:82:00.0",
                                           "0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0"]
    assert [c.hbm_used_mb for c in t.chips] == [2654] * 7 + [2653]
    assert {c.hbm_total_mb for c in t.chips} == {32768}
    assert {(c.memory_used_mb, c.memory_total_mb) for c in t.chips} == {(0, 0)}
    assert {c.aicore_pct for c in t.chips} == {0}
    assert t.processes == [] and t.idle_npus == list(range(8)) and t.pids() == {}
    assert t.chips[7].fields["HBM-Usage(MB)"] == "2653 / 32768"


def test_info_910A_table_with_health_and_processes():
    t = parse_info(recorded("info-910A-2.txt"))
    assert t.driver_version == "24.1.RC2"
    assert [c.device for c in t.chips] == [f"npu{n}-0" for n in range(8)]
    assert [c.health for c in t.chips] == ["OK", "OK", "OK", "Warning", "OK", "OK", "OK", "Warning"]
    assert [c.power_w for c in t.chips] == [70.5, 71.2, 69.0, 206.9, 70.2, 64.9, 69.4, 203.2]
    assert [c.temp_c for c in t.chips] == [42, 36, 35, 39, 39, 37, 40, 42]
    assert [c.memory_used_mb for c in t.chips] == [4252, 4666, 4317, 3616, 3708, 4346, 4261, 4521]
    assert [c.memory_total_mb for c in t.chips] == [15137, 15137, 15137, 15039, 15137, 15137, 15137, 15039]
    assert {(c.hbm_used_mb, c.hbm_total_mb) for c in t.chips} == {(0, 32768)}
    assert t.chips[3].bus_id == "0000:01:00.0" and t.chips[3].name == "xxx"
    assert t.chips[0].fields["Hugepages-Usage(page)"] == "1232 / 1232"
    assert len(t.processes) == 32 and t.idle_npus == []
    assert {(p.name, p.memory_mb) for p in t.processes} == {("hlt_host_devmm_", 686)}
    pids = t.pids()
    assert len(pids) == 32
    assert pids[37656] == "npu0-0" and pids[37665] == "npu1-0" and pids[37663] == "npu7-0"
    assert sorted(p for p, d in pids.items() if d == "npu3-0") == [37643, 37651, 37659, 37667]


def test_info_l():
    out = parse_kv(recorded("info-l-910B-1.txt"), "npu-smi info -l")
    assert out.fields == {"Total Count": "8"}
    assert [n.npu_id for n in out.npus] == list(range(8))
    assert all(n.fields == {"NPU ID": str(n.npu_id), "Chip Count": "1"} and n.chips == [] for n in out.npus)


def test_info_m():
    out = parse_kv(recorded("info-m-910A-1.txt"), "npu-smi info -m")
    assert [n.npu_id for n in out.npus] == list(range(8))
    for n in out.npus:
        assert [(r.chip_id, r.fields) for r in n.chips] == [(0, {"Chip Logic ID": str(n.npu_id), "Chip Name": "Ascend 910A"})]


def test_board():
    out = parse_kv(recorded("info-t-board-910B-1.txt"), "npu-smi info -t board -i 0")
    [(npu, chip, rec)] = chip_records(out, 0)
    assert (npu, chip) == (0, 0)
    assert rec.fields == {
        "Chip Type": "Ascend", "Chip Name": "xxx", "Chip Version": "V1", "Board ID": "0x02", "PCB ID": "NA",
        "BOM ID": "1", "VDie ID": "901421D4 02103514 1711E613 6DA7040A 00102001",
        "NDie ID": "05821994 20902110 1B11E613 6DA7040A 70102001", "Chip Position ID": "1",
        "PCIe Bus Info": "0000:81:00.0", "Firmware Version": "7.1.0.4.218",
    }


def test_common_chip_id_before_values_and_mcu_block():
    out = parse_kv(recorded("info-t-common-910B-1.txt"), "npu-smi info -t common -i 0")
    [npu] = out.npus
    assert npu.npu_id == 0 and npu.fields == {"NPU ID": "0", "Chip Count": "1"}
    [chip] = npu.chips
    assert chip.chip_id == 0
    assert chip.fields == {
        "Memory Usage Rate(%)": "6", "HBM Usage Rate(%)": "0", "Aicore Usage Rate(%)": "0",
        "Aicore Freq(MHZ)": "1000", "Aicore curFreq(MHZ)": "1000", "Aicore Count": "32",
        "Temperature(C)": "46", "NPU Real-time Power(W)": "69.0",
    }
    [mcu] = npu.extra
    assert mcu.fields == {"Chip Name": "mcu", "Temperature(C)": "48", "NPU Real-time Power(W)": "45.2"}
    assert by_name(power_samples(out, 0)) == {("hw.power",): 69.0}           # the MCU's 45.2 is not the chip's
    assert by_name(temp_samples(out, 0)) == {("hw.temperature", "chip"): 46.0}


def test_common_aicore_current_and_rated_clocks_in_hz():
    out = parse_kv(recorded("info-t-common-910B-1.txt"), "npu-smi info -t common -i 0")
    samples = common_samples(out, 0, [0], "npu-smi info -t common -i 0")
    assert [(s.name, s.value, s.unit, s.kind, s.labels) for s in samples] == [
        ("xpusense.accelerator.clock.frequency", 1000e6, "Hz", "gauge",
         {"device": "npu0-0", "vendor": "huawei", "clock": "aicore"}),
        ("xpusense.accelerator.clock.frequency", 1000e6, "Hz", "gauge",
         {"device": "npu0-0", "vendor": "huawei", "clock": "aicore_rated"}),
    ]
    held = recorded("info-t-common-910B-1.txt").replace("curFreq(MHZ)            : 1000", "curFreq(MHZ)            : 800")
    assert by_name(common_samples(parse_kv(held), 0)) == {
        ("xpusense.accelerator.clock.frequency", "aicore"): 800e6,
        ("xpusense.accelerator.clock.frequency", "aicore_rated"): 1000e6}


def test_common_malformed_clock_is_an_error_naming_the_field_and_keeping_the_rest():
    bad = recorded("info-t-common-910B-1.txt").replace("curFreq(MHZ)            : 1000", "curFreq(MHZ)            : 1000MHz")
    with pytest.raises(FieldError) as ei:
        common_samples(parse_kv(bad), 0, [0], "npu-smi info -t common -i 0")
    assert str(ei.value) == "`npu-smi info -t common -i 0`: `Aicore curFreq(MHZ)` of npu0-0 is not a number: '1000MHz'"
    assert ei.value.field == "Aicore curFreq(MHZ)" and isinstance(ei.value, ParseError)
    assert by_name(ei.value.partial) == {("xpusense.accelerator.clock.frequency", "aicore_rated"): 1000e6}
    neg = recorded("info-t-common-910B-1.txt").replace("Freq(MHZ)               : 1000", "Freq(MHZ)               : -5")
    with pytest.raises(FieldError, match=r"`Aicore Freq\(MHZ\)` of npu0-0 is out of range"):
        common_samples(parse_kv(neg), 0)


def test_common_without_clocks_or_with_na_gives_no_clock():
    na = recorded("info-t-common-910B-1.txt").replace("curFreq(MHZ)            : 1000", "curFreq(MHZ)            : NA")
    assert by_name(common_samples(parse_kv(na), 0)) == {("xpusense.accelerator.clock.frequency", "aicore_rated"): 1000e6}
    # the Atlas 200I A2 documentation's -t common: no Aicore Freq fields at all
    doc = ("\tNPU ID                         : 0\n\tChip Count                     : 1\n\n"
           "\tChip ID                        : 0\n\tMemory Usage Rate(%)           : 44\n"
           "\tAicore Usage Rate(%)           : 0\n\tTemperature(C)                 : 38\n")
    assert common_samples(parse_kv(doc), 0) == []


def test_health_alarm_with_three_codes_and_multiline_information():
    out = parse_kv(recorded("info-t-health-910A-2.txt"), "npu-smi info -t health -i 3")
    [r] = health_readings(out, 3, [0])
    assert (r.device, r.status, r.ok) == ("npu3-0", "Alarm", False)
    assert r.error_codes == "A4025021 8C03A000 8C084E00"
    assert r.error_information == (
        "ascend_monitor adda heart beat lost error\n"
        "node type=process-manager, sensor type=General Software, event state=The process start failed or exit abnormally\n"
        "node type=adda, sensor type=Heartbeat Sensor, event state=Heartbeat Lost.")
    [s] = health_samples([r])
    assert (s.name, s.value, s.unit, s.labels) == (
        "xpusense.accelerator.health", 0.0, "1", {"device": "npu3-0", "vendor": "huawei", "status": "Alarm"})


def test_power():
    out = parse_kv(recorded("info-t-power-910B-1.txt"), "npu-smi info -t power -i 0")
    [s] = power_samples(out, 0)
    assert (s.name, s.value, s.unit, s.labels) == ("hw.power", 103.5, "W", {"device": "npu0-0", "vendor": "huawei"})


def test_temp_chip_id_after_value_and_mcu_sensors_left_out():
    out = parse_kv(recorded("info-t-temp-910B-1.txt"), "npu-smi info -t temp -i 0")
    [s] = temp_samples(out, 0)
    assert (s.name, s.value, s.unit, s.labels) == (
        "hw.temperature", 39.0, "Cel", {"device": "npu0-0", "vendor": "huawei", "sensor": "chip"})
    [mcu] = out.npus[0].extra
    assert mcu.fields == {"LM75A_TE (C)": "36", "LM75B_TE (C)": "36", "Chip Name": "MCU"}


def test_usages_910A_raw_tabs():
    out = parse_kv(recorded("info-t-usages-910A-1.txt"), "npu-smi info -t usages -i 0")
    assert by_name(usages_samples(out, 0), "npu0-0") == {
        ("hw.gpu.utilization",): 0.0,
        ("xpusense.accelerator.hbm.bandwidth.utilization",): 0.0,
        ("hw.gpu.memory.limit",): 31129 * MIB,
        ("hw.gpu.memory.utilization",): 0.0,
        ("hw.gpu.memory.usage",): 0,
    }
    assert chip_records(out, 0)[0][2].get("DDR Capacity(MB)") == "13553"


def test_usages_910B_full_modern_field_set():
    out = parse_kv(recorded("info-t-usages-910B-2.txt"), "npu-smi info -t usages -i 0")
    samples = usages_samples(out, 0)
    assert by_name(samples, "npu0-0") == {
        ("hw.gpu.utilization",): 0.0,
        ("xpusense.accelerator.vector.utilization",): 0.0,
        ("xpusense.accelerator.cube.utilization",): 0.0,
        ("xpusense.accelerator.hbm.bandwidth.utilization",): 0.0,
        ("hw.gpu.memory.limit",): 65536 * MIB,
        ("hw.gpu.memory.utilization",): 0.05,
        ("hw.gpu.memory.usage",): round(65536 * MIB * 0.05),
    }
    assert {s.unit for s in samples if s.name.endswith("utilization")} == {"1"}
    assert {s.unit for s in samples if s.name.startswith("hw.gpu.memory.") and "utilization" not in s.name} == {"By"}


def test_inventory_910B4_from_the_table_and_the_catalog():
    t = parse_info(recorded("info-910B4-1.txt"))
    res = inventory_resources(t)
    assert len(res) == 8
    assert res[4] == {
        "type": "NPU", "vendor": "huawei", "model": "Ascend-910B4", "id": "npu4-0",
        "attributes": {"memory": "32GB", "chips_per_card": "1", "pci_bus_id": "0000:01:00.0",
                       "driver_version": "25.0.rc1.1", "matrix_units": "20", "matrix_unit_shape": "16x16x16",
                       "vector_units": "40"},
        "interconnects": [{"type": "HCCS"}],
    }


def test_inventory_910A_takes_the_chip_name_from_info_m_when_the_table_hides_it():
    t = parse_info(recorded("info-910A-2.txt"))
    m = parse_kv(recorded("info-m-910A-1.txt"), "npu-smi info -m")
    names = {f"npu{n.npu_id}-{r.chip_id}": r.get("Chip Name") for n in m.npus for r in n.chips}
    res = inventory_resources(t, names)
    assert {r["model"] for r in res} == {"Ascend-910A"}
    assert res[0]["attributes"]["matrix_units"] == "32"
    assert res[0]["interconnects"] == [{"type": "HCCS", "bandwidth": "90GB/s"}]
    assert inventory_resources(t)[0]["model"] == "Ascend-xxx"  # without -m: as printed


# -- layouts and formats beyond the recorded samples (written here, values made up) -------------

TABLE_310P = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.1                                   Version: 23.0.1                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 4       310P3                 | OK              | 21.5         47                0     / 0             |
| 0       0                     | 0000:81:00.0    | 12           2001 / 21534                            |
| 1       1                     | 0000:81:00.0    | 34           3002 / 21534                            |
+===============================+=================+======================================================+
"""

# A3-like: one block per chip, the second chip's power printed as "-", and a container pid column.
TABLE_A3 = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc3                 Version: 24.1.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 2     Ascend910           | OK            | 170.1       51                0    / 0             |
| 0     4                   | 0000:95:00.0  | 7           0    / 0          41000/ 65536         |
+------------------------------------------------------------------------------------------------+
| 2     Ascend910           | Warning       | -           53                0    / 0             |
| 1     5                   | 0000:97:00.0  | 9           0    / 0          3100 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name   | Process memory(MB) | Process id in container |
+===========================+===============+====================================================+
| 2       1                 | 4242          | python3 train  | 3000               | 17                      |
+===========================+===============+====================================================+
"""

# Columns in another order and other widths than any recorded layout; no Chip column (chip 0).
TABLE_REORDERED = """\
+--------------------------------------------------------------------------+
| npu-smi 99.0.0          Version: 99.0.0                                  |
+----------+------------+-----------+---------------------------------------+
| Health   | NPU ID     | Name      | Temp(C)    Power(W)                   |
| Bus-Id   |            |           | HBM-Usage(MB)      NPU Util(%)        |
+==========+============+===========+=======================================+
| Alarm    | 5          | X99       | 61         301.5                      |
| NA       |            |           | 7000 / 98304       42                 |
+==========+============+===========+=======================================+
"""


def test_310P_one_npu_row_several_chip_rows():
    t = parse_info(TABLE_310P)
    assert [(c.device, c.logic_id, c.aicore_pct, c.memory_used_mb, c.memory_total_mb) for c in t.chips] == [
        ("npu4-0", "0", 12, 2001, 21534), ("npu4-1", "1", 34, 3002, 21534)]
    assert [c.power_w for c in t.chips] == [21.5, None]        # the card's power is given once
    assert [c.temp_c for c in t.chips] == [47, 47] and t.chips[1].health == "OK"


def test_A3_blocks_per_chip_and_process_table():
    t = parse_info(TABLE_A3)
    assert [(c.device, c.phy_id, c.health, c.power_w, c.hbm_used_mb) for c in t.chips] == [
        ("npu2-0", "4", "OK", 170.1, 41000), ("npu2-1", "5", "Warning", None, 3100)]
    [p] = t.processes
    assert (p.device, p.pid, p.name, p.memory_mb) == ("npu2-1", 4242, "python3 train", 3000)
    assert normalize_model(t.chips[0].name) == "Ascend-910"
    assert common_catalog.huawei_model("Ascend-910") == {}   # A3's "Ascend910" is not the 910A


def test_columns_are_found_by_name_not_position():
    t = parse_info(TABLE_REORDERED)
    [c] = t.chips
    assert (c.device, c.health, c.name, c.temp_c, c.power_w, c.bus_id) == ("npu5-0", "Alarm", "X99", 61, 301.5, "")
    assert (c.hbm_used_mb, c.hbm_total_mb, c.npu_util_pct) == (7000, 98304, 42)


def test_kv_spaces_instead_of_tabs_and_no_chip_id():
    text = "    Health Status                  : OK\n    Error Code                     : NA\n"
    [r] = health_readings(parse_kv(text, "npu-smi info -t health -i 1"), 1, [0])
    assert (r.device, r.status, r.error_codes, r.error_information) == ("npu1-0", "OK", "", "")


def test_kv_several_chips_chip_id_after_or_absent():
    after = ("\tNPU ID : 1\n\tChip Count : 2\n\n\tAicore Usage Rate(%) : 11\n\tChip ID : 0\n"
             "\tAicore Usage Rate(%) : 22\n\tChip ID : 1\n")
    assert [(d, r.get("Aicore Usage Rate(%)")) for _, d, r in chip_records(parse_kv(after), 1)] == [(0, "11"), (1, "22")]
    absent = "\tAicore Usage Rate(%) : 11\n\tHBM Usage Rate(%) : 1\n\tAicore Usage Rate(%) : 22\n"
    recs = chip_records(parse_kv(absent), 7, [0, 1])
    assert [(n, c, r.get("Aicore Usage Rate(%)")) for n, c, r in recs] == [(7, 0, "11"), (7, 1, "22")]


def test_card_level_health_applies_to_every_chip_of_the_card():
    out = parse_kv("\tHealth Status : Critical\n\tError Code : 80E18005\n", "npu-smi info -t health -i 2")
    readings = health_readings(out, 2, [0, 1])
    assert [(r.device, r.status, r.error_codes) for r in readings] == [
        ("npu2-0", "Critical", "80E18005"), ("npu2-1", "Critical", "80E18005")]


def test_chip_without_hbm_reports_ddr():
    out = parse_kv("\tNPU ID : 4\n\tChip Count : 1\n\n\tDDR Capacity(MB) : 21534\n\tDDR Usage Rate(%) : 10\n"
                   "\tAicore Usage Rate(%) : 3\n\tChip ID : 0\n")
    s = by_name(usages_samples(out, 4))
    assert s[("hw.gpu.memory.limit",)] == 21534 * MIB and s[("hw.gpu.memory.utilization",)] == 0.1


# -- errors ---------------------------------------------------------------------------------------

def test_parse_error_names_command_and_first_bad_line_and_keeps_the_rest():
    text = recorded("info-t-usages-910B-2.txt").replace("        HBM Usage Rate(%)              : 5\n",
                                                          "        HBM Usage Rate(%)              : 5\nSegmentation fault\n??\n")
    cmd = "npu-smi info -t usages -i 0"
    with pytest.raises(ParseError) as ei:
        parse_kv(text, cmd)
    e = ei.value
    assert (e.command, e.line_no, e.line) == (cmd, 10, "Segmentation fault")
    assert cmd in str(e) and "line 10" in str(e) and "Segmentation fault" in str(e)
    s = by_name(usages_samples(e.partial, 0))
    assert s[("hw.gpu.memory.utilization",)] == 0.05 and s[("xpusense.accelerator.cube.utilization",)] == 0.0


def test_table_error_keeps_the_other_chips():
    text = recorded("info-910B4-1.txt").replace("| 5     910B4  ", "| x5    910B4  ")
    with pytest.raises(ParseError) as ei:
        parse_info(text)
    assert ei.value.line_no == 22 and ei.value.line.startswith("| x5    910B4")
    assert "NPU row without a numeric NPU id" in str(ei.value)
    assert [c.npu_id for c in ei.value.partial.chips] == [0, 1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize("parse", [parse_info, parse_kv])
@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_output_is_a_parse_error(parse, text):
    with pytest.raises(ParseError) as ei:
        parse(text, "npu-smi info")
    assert ei.value.line_no == 0 and "no output" in str(ei.value)


# -- fuzzing --------------------------------------------------------------------------------------

ALL_TEXTS = [(FIXTURES / n).read_text() for n in RECORDED] + [TABLE_310P, TABLE_A3, TABLE_REORDERED]


@st.composite
def mangled(draw):
    text = draw(st.sampled_from(ALL_TEXTS))
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["cut", "drop", "dup", "swap", "insert", "char", "trunc_line"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "cut":
            lines = lines[:i]
        elif op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "insert":
            lines.insert(i, draw(st.text(max_size=40)) + "\n")
        elif op == "char":
            ln = lines[i]
            k = draw(st.integers(0, max(0, len(ln) - 1)))
            lines[i] = ln[:k] + draw(st.text(min_size=0, max_size=3)) + ln[k + 1:]
        else:
            lines[i] = lines[i][:draw(st.integers(0, len(lines[i])))]
    return "".join(lines)


def check_parse(parse, text, command):
    try:
        result = parse(text, command)
    except ParseError as e:
        assert e.command == command and command in str(e)
        lines = text.splitlines()
        assert 0 <= e.line_no <= len(lines)
        if e.line_no:
            assert e.line == lines[e.line_no - 1] and f"line {e.line_no}" in str(e)
        result = e.partial
    return result


def exercise_converters(result):
    if isinstance(result, KvOutput):
        recs = chip_records(result, 3, [0, 1])
        assert all(isinstance(c, int) for _, c, _ in recs)
        for f in (usages_samples, power_samples, temp_samples):
            f(result, 3, [0, 1])
        health_samples(health_readings(result, 3, [0, 1]))
        try:
            clocks = common_samples(result, 3, [0, 1])
        except FieldError as e:          # the only error a mangled value may give, naming its field
            assert e.field and "of npu" in str(e)
            clocks = e.partial
        assert all(s.unit == "Hz" and s.value >= 0 and s.labels["clock"] in ("aicore", "aicore_rated") for s in clocks)
    else:
        inventory_resources(result, {})
        result.pids()


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mangled())
def test_fuzz_parse_info_mangled(text):
    exercise_converters(check_parse(parse_info, text, "npu-smi info"))


@FUZZ
@given(mangled())
def test_fuzz_parse_kv_mangled(text):
    exercise_converters(check_parse(parse_kv, text, "npu-smi info -t usages -i 3"))


@FUZZ
@given(st.sampled_from(ALL_TEXTS), st.data())
def test_fuzz_truncated(text, data):
    cut = text[:data.draw(st.integers(0, len(text)))]
    exercise_converters(check_parse(parse_info, cut, "npu-smi info"))
    exercise_converters(check_parse(parse_kv, cut, "npu-smi info -t health -i 3"))


@FUZZ
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=300))
def test_fuzz_any_text(text):
    exercise_converters(check_parse(parse_info, text, "npu-smi info"))
    exercise_converters(check_parse(parse_kv, text, "npu-smi info -m"))


@FUZZ
@given(st.lists(st.sampled_from(["| 0  910B4 | OK | 1.5  33  0 / 0 |", "| 0 | 0000:01:00.0 | 1  0 / 0  5 / 9 |",
                                 "+====+====+", "+----+", "| NPU  Name | Health | Power(W)  Temp(C) |",
                                 "| Chip | Bus-Id | AICore(%)  HBM-Usage(MB) |", "| NPU  Chip | Process id | Process name |",
                                 "| 0  0 | 12 | x |", "| No running processes found in NPU 0 |", "\tChip ID : 0",
                                 "\tNPU ID : 1", "\t : more", "\tHealth Status : Alarm", "", "junk"]), max_size=30))
def test_fuzz_recombined_lines(lines):
    text = "\n".join(lines)
    exercise_converters(check_parse(parse_info, text, "npu-smi info"))
    exercise_converters(check_parse(parse_kv, text, "npu-smi info -t health -i 3"))


def test_module_names_one_source():
    assert NpuSmiSource.name == "npu-smi"
    assert NpuSmiSource.tiers == ("realtime", "nearline", "offline")


def test_a_bad_npu_id_followed_by_a_continuation_line_is_a_parse_error():
    # Not a KeyError (the continuation must not be appended to a key the bad NPU never had).
    with pytest.raises(ParseError, match="NPU ID is not a number at line 1") as e:
        parse_kv("NPU ID : x\n\t : more\nChip ID : 0\nPower(W) : 3\n")
    assert e.value.partial.npus[0].npu_id is None
