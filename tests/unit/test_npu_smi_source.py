"""The npu-smi source against the fake npu-smi (tests/fakes/npu-smi/npu-smi) and recorded scenarios.

No sleeps for synchronisation and no wall-clock assertions: budgets are generous where a round
must finish, and tiny against a fake told to hang where it must not.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from xpusense.agent.sources.base import NEARLINE, OFFLINE, REALTIME, SourceError, Unavailable
from xpusense.agent.sources.npu_smi.source import OVERSIZED_METRIC, SKIPPED_METRIC, NpuSmiSource
from xpusense.agent.sources.npu_smi.values import MIB

TESTS = Path(__file__).resolve().parents[1]
FAKE = TESTS / "fakes" / "npu-smi" / "npu-smi"
FIXTURES = TESTS / "fixtures" / "npu-smi"
SCENARIO = FIXTURES / "scenario-8x910B4"
GENEROUS_S = 120.0  # a budget no healthy round comes near, even on a loaded CI host
TABLE_POWER = [87.2, 82.7, 82.7, 89.1, 84.5, 84.8, 87.1, 81.6]
TABLE_TEMP = [33, 33, 33, 34, 39, 37, 38, 37]


@pytest.fixture
def scenario(tmp_path, monkeypatch):
    d = tmp_path / "scenario"
    shutil.copytree(SCENARIO, d)
    monkeypatch.setenv("FAKE_NPU_SMI_DIR", str(d))
    monkeypatch.setenv("FAKE_NPU_SMI_LOG", str(tmp_path / "calls.log"))
    for k in ("FAKE_NPU_SMI_DELAY_S", "FAKE_NPU_SMI_DELAY_ON", "FAKE_NPU_SMI_T0", "FAKE_NPU_SMI_NOW"):
        monkeypatch.delenv(k, raising=False)
    return d


@pytest.fixture
def source(scenario):
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S, offline_timeout_s=GENEROUS_S)
    src.setup()
    yield src
    src.close()


def calls(tmp_path) -> list[str]:
    return (tmp_path / "calls.log").read_text().splitlines()


def values(samples, device):
    out = {}
    for s in samples:
        if s.labels.get("device") == device:
            extra = tuple(v for k, v in sorted(s.labels.items()) if k not in ("device", "vendor"))
            out[(s.name, *extra)] = s.value
    return out


def skipped(samples):
    [s] = [s for s in samples if s.name == SKIPPED_METRIC]
    assert s.kind == "counter" and s.unit == "{round}"
    return s.value


def test_committed_scenario_is_what_the_generator_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_scenario", FIXTURES / "make_scenario.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = mod.write(str(tmp_path / "fresh"))
    assert sorted(names) == sorted(p.name for p in SCENARIO.iterdir())
    for n in names:
        assert (tmp_path / "fresh" / n).read_bytes() == (SCENARIO / n).read_bytes(), n
    assert (SCENARIO / "info.txt").read_bytes() == (FIXTURES / "info-910B4-1.txt").read_bytes()


def test_discovers_8_npus(source, tmp_path):
    d = source.describe()
    assert d["npus"] == list(range(8))
    assert d["devices"] == [f"npu{n}-0" for n in range(8)]
    assert d["driver_version"] == "25.0.rc1.1" and d["path"] == str(FAKE)
    assert calls(tmp_path) == ["info"]  # the table named the chips: no `-m` needed


def test_realtime_round_reads_every_npu_concurrently(source, tmp_path):
    samples = source.collect(REALTIME)
    for n in range(8):
        assert values(samples, f"npu{n}-0") == {
            ("hw.gpu.utilization",): 10 * (n + 1) / 100,
            ("xpusense.accelerator.vector.utilization",): 5 * n / 100,
            ("xpusense.accelerator.cube.utilization",): 10 * (n + 1) / 100,
            ("xpusense.accelerator.hbm.bandwidth.utilization",): (3 + 7 * n) / 100,
            ("hw.gpu.memory.limit",): 32768 * MIB,
            ("hw.gpu.memory.utilization",): 0.08,
            ("hw.gpu.memory.usage",): round(32768 * MIB * 0.08),
        }
    assert {s.labels["vendor"] for s in samples if "device" in s.labels} == {"huawei"}
    assert skipped(samples) == 0
    assert sorted(calls(tmp_path)[1:]) == sorted(f"info -t usages -i {n}" for n in range(8))
    assert source.describe()["rounds_skipped"] == {"realtime": 0, "nearline": 0, "offline": 0}


def test_offline_round_power_temperature_health(source):
    samples = source.collect(OFFLINE)
    for n in range(8):
        assert values(samples, f"npu{n}-0") == {
            ("hw.power",): TABLE_POWER[n],
            ("hw.temperature", "chip"): TABLE_TEMP[n],
            ("xpusense.accelerator.health", "OK"): 1.0,
            ("xpusense.accelerator.npu.error_code",): 0.0,
        }
    assert skipped(samples) == 0
    assert source.events() == []  # first reading, all OK: nothing changed


CLOCK = "xpusense.accelerator.clock.frequency"


def test_nearline_round_reads_the_ai_core_clocks_of_every_npu(source, scenario, tmp_path):
    (scenario / "common-6.txt").write_text((scenario / "common-6.txt").read_text().replace(
        "curFreq(MHZ)            : 1000", "curFreq(MHZ)            : 650"))
    samples = source.collect(NEARLINE)
    for n in range(8):
        assert values(samples, f"npu{n}-0") == {(CLOCK, "aicore"): (650e6 if n == 6 else 1000e6),
                                                 (CLOCK, "aicore_rated"): 1000e6}
    assert {s.unit for s in samples if s.name == CLOCK} == {"Hz"}
    assert skipped(samples) == 0 and [s.labels for s in samples if s.name == SKIPPED_METRIC] == [{"tier": "nearline"}]
    assert sorted(calls(tmp_path)[1:]) == sorted([*(f"info -t common -i {n}" for n in range(8)), "info"])


def test_common_not_supported_is_said_once_and_not_asked_again(source, scenario, tmp_path, caplog):
    """npu-smi of a model without `-t common`: failing with its message (NPU 3), or printing only the
    message and exiting 0 (NPU 5). Neither fails the round; neither NPU is asked again."""
    (scenario / "common-3.txt").unlink()    # the fake answers "... does not support this query (-t common)"
    (scenario / "common-5.txt").write_text("This device does not support querying common.\n")
    first = source.collect(NEARLINE)
    assert {s.labels["device"] for s in first if s.name == CLOCK} == {f"npu{n}-0" for n in range(8) if n not in (3, 5)}
    assert source.describe()["unsupported_queries"] == {
        "npu-smi info -t common -i 3": "Error: the device 3 does not exist or does not support this query (-t common).",
        "npu-smi info -t common -i 5": "This device does not support querying common.",
    }
    said = [r.getMessage() for r in caplog.records if "not supported here" in r.getMessage()]
    assert len(said) == 2 and "`npu-smi info -t common -i 3`" in said[0]
    second = source.collect(NEARLINE)
    assert len([s for s in second if s.name == CLOCK]) == 2 * 6
    asked = [c for c in calls(tmp_path) if c.startswith("info -t common")]
    assert sorted(asked) == sorted([f"info -t common -i {n}" for n in range(8)]
                                   + [f"info -t common -i {n}" for n in range(8) if n not in (3, 5)])
    assert len([r for r in caplog.records if "not supported here" in r.getMessage()]) == 2   # not said again
    assert skipped(second) == 0


def test_common_failing_otherwise_is_an_error_and_asked_again(source, scenario, tmp_path):
    (scenario / "fail-common-2.txt").write_text("Error: the device 2 is busy, try again later.\n")
    for _ in range(2):
        with pytest.raises(SourceError, match="`npu-smi info -t common -i 2` exited with 1: Error: the device 2 is busy"):
            source.collect(NEARLINE)
    assert [c for c in calls(tmp_path) if c == "info -t common -i 2"] == ["info -t common -i 2"] * 2
    assert source.describe()["unsupported_queries"] == {}


def test_common_malformed_clock_is_a_source_error_naming_the_field_and_keeping_the_rest(source, scenario):
    (scenario / "common-4.txt").write_text((scenario / "common-4.txt").read_text().replace(
        "curFreq(MHZ)            : 1000", "curFreq(MHZ)            : 1000MHz"))
    with pytest.raises(SourceError) as ei:
        source.collect(NEARLINE)
    assert str(ei.value) == "`npu-smi info -t common -i 4`: `Aicore curFreq(MHZ)` of npu4-0 is not a number: '1000MHz'"
    kept = ei.value.samples
    assert values(kept, "npu4-0") == {(CLOCK, "aicore_rated"): 1000e6}
    assert values(kept, "npu7-0") == {(CLOCK, "aicore"): 1000e6, (CLOCK, "aicore_rated"): 1000e6}
    assert skipped(kept) == 0


def test_slow_common_round_is_skipped_and_counted_apart_from_the_other_tiers(scenario, monkeypatch):
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S, nearline_timeout_s=0.3, offline_timeout_s=GENEROUS_S)
    src.setup()
    try:
        monkeypatch.setenv("FAKE_NPU_SMI_DELAY_S", "600")
        monkeypatch.setenv("FAKE_NPU_SMI_DELAY_ON", "common")
        first = src.collect(NEARLINE)
        assert [s.name for s in first] == [SKIPPED_METRIC, OVERSIZED_METRIC] and skipped(first) == 1
        assert src.describe()["rounds_skipped"] == {"realtime": 0, "nearline": 1, "offline": 0}
        assert src.describe()["unsupported_queries"] == {}     # late is not unsupported
        assert skipped(src.collect(REALTIME)) == 0
        monkeypatch.delenv("FAKE_NPU_SMI_DELAY_S")
        src.nearline_timeout_s = GENEROUS_S
        again = src.collect(NEARLINE)
        assert skipped(again) == 1 and len([s for s in again if s.name == CLOCK]) == 16
    finally:
        src.close()


def test_ai_core_clock_ramp_plays_over_time(source, scenario, monkeypatch):
    (scenario / "ramp.json").write_text(
        '{"type": "common", "key": "Aicore curFreq(MHZ)", "npus": [5], "points": [[0, 1000], [60, 500]]}')
    monkeypatch.setenv("FAKE_NPU_SMI_T0", "1000")
    seen = []
    for now in ("1000", "1030", "2000"):
        monkeypatch.setenv("FAKE_NPU_SMI_NOW", now)
        samples = source.collect(NEARLINE)
        seen.append(values(samples, "npu5-0")[(CLOCK, "aicore")])
        assert values(samples, "npu5-0")[(CLOCK, "aicore_rated")] == 1000e6
        assert values(samples, "npu4-0")[(CLOCK, "aicore")] == 1000e6
    assert seen == [1000e6, 750e6, 500e6]


def test_inventory(source):
    inv = source.inventory()
    assert [r["id"] for r in inv] == [f"npu{n}-0" for n in range(8)]
    assert inv[2] == {
        "type": "NPU", "vendor": "huawei", "model": "Ascend-910B4", "id": "npu2-0",
        "attributes": {"memory": "32GB", "chips_per_card": "1", "pci_bus_id": "0000:81:00.0",
                       "driver_version": "25.0.rc1.1", "matrix_units": "20", "matrix_unit_shape": "16x16x16",
                       "vector_units": "40"},
        "interconnects": [{"type": "HCCS"}],
    }


def test_slow_npu_smi_round_is_skipped_and_counted_not_queued(scenario, monkeypatch):
    src = NpuSmiSource(path=str(FAKE), timeout_s=0.3, offline_timeout_s=GENEROUS_S)
    src.setup()
    try:
        monkeypatch.setenv("FAKE_NPU_SMI_DELAY_S", "600")   # far beyond any budget: only a kill ends it
        monkeypatch.setenv("FAKE_NPU_SMI_DELAY_ON", "usages")
        first = src.collect(REALTIME)
        assert [s.name for s in first] == [SKIPPED_METRIC, OVERSIZED_METRIC] and skipped(first) == 1
        d = src.describe()
        assert d["rounds_skipped"]["realtime"] == 1
        assert sorted(d["last_late_commands"]["realtime"]) == sorted(f"npu-smi info -t usages -i {n}" for n in range(8))
        assert skipped(src.collect(REALTIME)) == 2
        # the offline tier is not held up by the realtime tier's trouble
        assert values(src.collect(OFFLINE), "npu0-0")[("hw.power",)] == 87.2
        # npu-smi recovers: the next round reads everything, the count stays
        monkeypatch.delenv("FAKE_NPU_SMI_DELAY_S")
        src.timeout_s = GENEROUS_S
        third = src.collect(REALTIME)
        assert skipped(third) == 2 and len({s.labels["device"] for s in third if "device" in s.labels}) == 8
    finally:
        src.close()


def test_malformed_output_is_a_source_error_naming_the_command_and_keeping_the_rest(source, scenario):
    good = (scenario / "usages-3.txt").read_text()
    (scenario / "usages-3.txt").write_text(good.replace("\tAicore Usage Rate(%)", "dcmi_get_device_info failed\n\tAicore Usage Rate(%)"))
    with pytest.raises(SourceError) as ei:
        source.collect(REALTIME)
    msg = str(ei.value)
    assert "npu-smi info -t usages -i 3" in msg and "dcmi_get_device_info failed" in msg and "line 10" in msg
    kept = ei.value.samples
    assert {s.labels["device"] for s in kept if "device" in s.labels} == {f"npu{n}-0" for n in range(8)}
    assert values(kept, "npu3-0")[("xpusense.accelerator.hbm.bandwidth.utilization",)] == 0.24
    assert skipped(kept) == 0


def test_failing_command_is_a_source_error(source, scenario):
    (scenario / "fail-usages-5.txt").write_text("Error: the device 5 is busy, try again later.\n")
    with pytest.raises(SourceError) as ei:
        source.collect(REALTIME)
    assert "`npu-smi info -t usages -i 5` exited with 1: Error: the device 5 is busy" in str(ei.value)
    assert {s.labels["device"] for s in ei.value.samples if "device" in s.labels} == {f"npu{n}-0" for n in range(8) if n != 5}


def test_missing_executable_is_unavailable_with_a_reason(tmp_path, monkeypatch):
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(path=str(tmp_path / "nowhere" / "npu-smi")).setup()
    assert "npu-smi not found at" in str(ei.value) and "--npu-smi" in str(ei.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(search_dirs=[str(empty)]).setup()
    assert "npu-smi not found in" in str(ei.value) and "install the Ascend NPU driver" in str(ei.value)

    plain = tmp_path / "plain-file"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(path=str(plain)).setup()
    assert "not executable" in str(ei.value)


def test_found_in_the_driver_dirs_then_on_path(scenario, tmp_path, monkeypatch):
    sbin = tmp_path / "usr local sbin"   # a space: argv lists, never a shell
    sbin.mkdir()
    os.symlink(FAKE, sbin / "npu-smi")
    src = NpuSmiSource(search_dirs=[str(tmp_path / "absent"), str(sbin)])
    src.setup()
    assert src.describe()["path"] == str(sbin / "npu-smi") and len(src.describe()["npus"]) == 8
    src.close()
    monkeypatch.setenv("PATH", f"{sbin}{os.pathsep}{os.environ['PATH']}")
    src = NpuSmiSource(search_dirs=[str(tmp_path / "absent")])
    src.setup()
    assert src.describe()["path"] == str(sbin / "npu-smi")
    src.close()


def test_npu_smi_info_failing_is_unavailable(scenario):
    (scenario / "info.txt").unlink()
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(path=str(FAKE)).setup()
    assert "`npu-smi info` exited with 1" in str(ei.value) and "driver" in str(ei.value)


def test_npu_smi_info_hanging_is_unavailable(scenario, monkeypatch):
    monkeypatch.setenv("FAKE_NPU_SMI_DELAY_S", "600")
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(path=str(FAKE), setup_timeout_s=0.3).setup()
    assert "did not answer within 0.3 s" in str(ei.value)


def test_no_npus_is_unavailable(scenario):
    text = (scenario / "info.txt").read_text().splitlines(keepends=True)
    (scenario / "info.txt").write_text("".join(text[:6]))
    (scenario / "info-l.txt").write_text("\tTotal Count                    : 0\n")
    with pytest.raises(Unavailable) as ei:
        NpuSmiSource(path=str(FAKE)).setup()
    assert "listed no NPUs" in str(ei.value)


def test_unreadable_table_falls_back_to_info_l(scenario):
    (scenario / "info.txt").write_text("some future layout npu-smi prints\n")
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S)
    src.setup()
    try:
        assert src.describe()["npus"] == list(range(8))
        assert "`npu-smi info`: line not understood at line 1" in src.describe()["notes"][0]
        assert len({s.labels["device"] for s in src.collect(REALTIME) if "device" in s.labels}) == 8
    finally:
        src.close()


def test_health_change_is_an_event_with_codes_and_information_whole(source, scenario):
    source.collect(OFFLINE)
    assert source.events() == []
    shutil.copyfile(FIXTURES / "info-t-health-910A-2.txt", scenario / "health-3.txt")
    samples = source.collect(OFFLINE)
    assert values(samples, "npu3-0")[("xpusense.accelerator.health", "Alarm")] == 0.0
    [ev] = source.events()
    assert (ev.type, ev.device, ev.severity) == ("health", "npu3-0", "critical")
    assert ev.message == "npu3-0 health OK -> Alarm; error codes A4025021 8C03A000 8C084E00"
    assert ev.attributes["status"] == "Alarm" and ev.attributes["previous"] == "OK"
    assert ev.attributes["error_codes"] == "A4025021 8C03A000 8C084E00"
    assert ev.attributes["error_information"].splitlines() == [
        "ascend_monitor adda heart beat lost error",
        "node type=process-manager, sensor type=General Software, event state=The process start failed or exit abnormally",
        "node type=adda, sensor type=Heartbeat Sensor, event state=Heartbeat Lost."]
    assert ev.time_ns > 0
    assert source.events() == []                 # handed out once
    source.collect(OFFLINE)
    assert source.events() == []                 # still Alarm, same codes: no change
    (scenario / "health-3.txt").write_text((SCENARIO / "health-3.txt").read_text())
    source.collect(OFFLINE)
    [back] = source.events()
    assert (back.device, back.severity, back.attributes["status"], back.attributes["previous"]) == (
        "npu3-0", "info", "OK", "Alarm")


def test_910A_host_processes_and_model_from_info_m(scenario, tmp_path):
    shutil.copyfile(FIXTURES / "info-910A-2.txt", scenario / "info.txt")
    shutil.copyfile(FIXTURES / "info-m-910A-1.txt", scenario / "info-m.txt")
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S, offline_timeout_s=GENEROUS_S)
    src.setup()
    try:
        assert calls(tmp_path) == ["info", "info -m"]   # the table's names are redacted ("xxx")
        inv = src.inventory()
        assert {r["model"] for r in inv} == {"Ascend-910A"}
        assert inv[0]["interconnects"] == [{"type": "HCCS", "bandwidth": "90GB/s"}]
        pids = src.processes()
        assert len(pids) == 32
        assert pids[37656] == {"npu0-0"} and pids[37671] == {"npu7-0"}
    finally:
        src.close()


def test_nearline_round_reads_each_processs_memory_from_the_table(scenario, tmp_path):
    """npu-smi's only per-process figure: `Process memory(MB)` in `npu-smi info`'s table, read
    again each nearline round (a process that started since setup is there) and labelled with its
    pid, so agent/pods.py names its pod and agent/pod_rollup.py sums it per pod."""
    shutil.copyfile(FIXTURES / "info-910A-2.txt", scenario / "info.txt")
    shutil.copyfile(FIXTURES / "info-m-910A-1.txt", scenario / "info-m.txt")
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S, offline_timeout_s=GENEROUS_S,
                       nearline_timeout_s=GENEROUS_S)
    src.setup()
    try:
        (scenario / "info.txt").write_text((scenario / "info.txt").read_text().replace(
            "| 0       0            | 37656         | hlt_host_devmm_          | 686 ",
            "| 0       0            | 40001         | trainer                  | 30000"))
        memory = {(s.labels["device"], s.labels["pid"]): s.value for s in src.collect(NEARLINE)
                  if s.name == "xpusense.accelerator.process.memory.usage"}
        assert len(memory) == 32
        assert memory[("npu0-0", "40001")] == 30000 * MIB and ("npu0-0", "37656") not in memory
        assert memory[("npu7-0", "37671")] == 686 * MIB
        assert src.processes()[40001] == {"npu0-0"}
    finally:
        src.close()


def test_hbm_bandwidth_ramp_plays_over_time(source, scenario, monkeypatch):
    (scenario / "ramp.json").write_text(
        '{"type": "usages", "key": "HBM Bandwidth Usage Rate(%)", "npus": [2], "points": [[0, 20], [30, 20], [60, 95]]}')
    monkeypatch.setenv("FAKE_NPU_SMI_T0", "1000")
    seen = []
    for now in ("1000", "1045", "2000"):
        monkeypatch.setenv("FAKE_NPU_SMI_NOW", now)
        samples = source.collect(REALTIME)
        seen.append(values(samples, "npu2-0")[("xpusense.accelerator.hbm.bandwidth.utilization",)])
        assert values(samples, "npu1-0")[("xpusense.accelerator.hbm.bandwidth.utilization",)] == 0.10
    assert seen == [0.20, 0.58, 0.95]


def test_fake_rejects_unknown_commands_like_npu_smi(scenario):
    r = subprocess.run([str(FAKE), "bogus"], capture_output=True, text=True)
    assert r.returncode == 1 and "Error: invalid command bogus" in r.stderr and "Usage: npu-smi info" in r.stderr
    r = subprocess.run([str(FAKE), "info", "-t", "usages", "-i", "99"], capture_output=True, text=True)
    assert r.returncode == 1 and "device 99 does not exist" in r.stderr
    r = subprocess.run([str(FAKE), "info", "-t", "usages"], capture_output=True, text=True)
    assert r.returncode == 1 and "-i id" in r.stderr
    r = subprocess.run([str(FAKE), "info", "-t", "usages", "-i", "4", "-c", "0"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == (scenario / "usages-4.txt").read_text()


def test_endless_output_is_cut_at_the_bound_and_the_call_killed(source, scenario, tmp_path):
    """`yes` as npu-smi for one NPU: that call is killed past max_output_bytes and counted; the other
    NPUs are read; the agent's memory does not follow the output."""
    import psutil
    from helpers import record_figure
    wrapper = tmp_path / "npu-smi"
    wrapper.write_text(f'#!/bin/sh\nif [ "$*" = "info -t usages -i 3" ]; then exec yes npu; fi\nexec "{FAKE}" "$@"\n')
    wrapper.chmod(0o755)
    src = NpuSmiSource(path=str(wrapper), timeout_s=GENEROUS_S, offline_timeout_s=GENEROUS_S,
                       max_output_bytes=1 << 20)
    src.setup()
    rss_before = psutil.Process().memory_info().rss
    try:
        with pytest.raises(SourceError) as ei:
            src.collect(REALTIME)
        assert "`npu-smi info -t usages -i 3` printed more than 1048576 bytes" in str(ei.value)
        kept = ei.value.samples
        assert {s.labels["device"] for s in kept if "device" in s.labels} == {f"npu{n}-0" for n in range(8) if n != 3}
        [oversized] = [s for s in kept if s.name == "xpusense.npu_smi.calls.oversized"]
        assert oversized.value == 1 and oversized.kind == "counter"
        assert src.describe()["calls_killed_for_output_size"] == 1
    finally:
        src.close()
    grown_mb = (psutil.Process().memory_info().rss - rss_before) / 2**20
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["yes", "npu"]], "yes still runs"
    record_figure("npu-smi endless output", max_output_bytes=1 << 20, rss_growth_mb=round(grown_mb, 1))
    assert grown_mb < 64


def test_output_within_the_bound_is_read_whole(scenario):
    import time

    from xpusense.agent.sources.npu_smi.runner import OutputTooLarge, Runner
    r = Runner(["realtime"], 1, max_output_bytes=200_000)
    r.exe = "/bin/sh"
    assert r.run(["-c", "yes x | head -c 150000"], time.monotonic() + GENEROUS_S) == "x\n" * 75000
    with pytest.raises(OutputTooLarge, match="printed more than 200000 bytes"):
        r.run(["-c", "head -c 250000 /dev/zero"], time.monotonic() + GENEROUS_S)
    assert r.oversized == 1
