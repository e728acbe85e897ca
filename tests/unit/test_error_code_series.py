"""XIDs and npu-smi error codes as counters: what counts as an occurrence, the bound on codes per
device (further codes under `other`, counted as over the limit), the last code, and the npu-smi
source's series from recorded health outputs through the fake npu-smi."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from xpusense.agent.sources.base import COUNTER, OFFLINE
from xpusense.agent.sources.code_counts import OTHER, OVER_LIMIT, CodeCounts
from xpusense.agent.sources.npu_smi.error_codes import ErrorCodes
from xpusense.agent.sources.npu_smi.readings import HealthReading
from xpusense.agent.sources.npu_smi.source import SCHEMA, NpuSmiSource
from xpusense.agent.sources.nvml.source import SCHEMA as NVML_SCHEMA
from xpusense.common import metric_names as m
from xpusense.common.config import ConfigError, load

TESTS = Path(__file__).resolve().parents[1]
FAKE = TESTS / "fakes" / "npu-smi" / "npu-smi"
FIXTURES = TESTS / "fixtures" / "npu-smi"
GPU0 = {"device": "gpu0", "vendor": "nvidia"}


def counts(samples, name=m.XID_ERRORS, label="xid"):
    return {(s.labels["device"], s.labels[label]): s.value for s in samples if s.name == name}


def over(samples):
    return {s.labels["device"]: s.value for s in samples if s.name == OVER_LIMIT}


def test_each_occurrence_counts_per_device_and_code_as_a_counter_with_the_last_code():
    c = CodeCounts(m.XID_ERRORS, "xid", 8)
    assert c.samples() == [] and c.last("gpu0") is None
    for code in ("79", "13", "79"):
        c.add(GPU0, code)
    c.add({"device": "gpu1", "vendor": "nvidia"}, "48")
    out = c.samples()
    assert counts(out) == {("gpu0", "79"): 2, ("gpu0", "13"): 1, ("gpu1", "48"): 1}
    assert {(s.kind, s.unit) for s in out} == {(COUNTER, "{error}")}
    assert next(s for s in out if s.labels["xid"] == "13").labels == {**GPU0, "xid": "13"}
    assert (c.last("gpu0"), c.last("gpu1"), c.last("gpu2")) == ("79", "48", None)
    assert over(out) == {}


def test_codes_past_the_bound_count_as_other_and_over_the_limit_never_lost():
    c = CodeCounts(m.XID_ERRORS, "xid", 2)
    for code in ("13", "31", "43", "13", "45", "43"):
        c.add(GPU0, code)
    out = c.samples()
    assert counts(out) == {("gpu0", "13"): 2, ("gpu0", "31"): 1, ("gpu0", OTHER): 3}
    assert sum(counts(out).values()) == 6
    assert over(out) == {"gpu0": 3}
    assert c.last("gpu0") == "43"          # the last code stays the real one
    c.add({"device": "gpu1", "vendor": "nvidia"}, "79")   # the bound is per device
    assert counts(c.samples())[("gpu1", "79")] == 1


def test_the_bound_must_be_positive_in_code_and_config(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        CodeCounts(m.XID_ERRORS, "xid", 0)
    for table, schema, key in (("nvml", NVML_SCHEMA, "xid_codes_per_device"), ("npu_smi", SCHEMA, "error_codes_per_device")):
        assert schema[key].default == 32 and schema[key].help
        path = tmp_path / f"{table}.toml"
        path.write_text(f"[sources.{table}]\n{key} = 0\n")
        with pytest.raises(ConfigError, match=f"sources.{table}.{key}"):
            load({"sources": {table: schema}}, str(path))
        path.write_text(f"[sources.{table}]\n{key} = 5\n")
        assert getattr(getattr(load({"sources": {table: schema}}, str(path)).sources, table), key) == 5


def reading(codes: str, chip: int = 0) -> HealthReading:
    return HealthReading(3, chip, "Alarm" if codes else "OK", codes)


def test_an_npu_code_counts_each_time_it_appears_in_the_list_not_every_reading():
    e = ErrorCodes(32)
    e.saw([reading("A4025021 8C03A000")])            # listed at the first reading: once each
    e.saw([reading("A4025021 8C03A000")])            # still listed: no new occurrence
    e.saw([reading("8C03A000")])                     # A4025021 cleared
    e.saw([reading("a4025021 8C03A000")])            # and back: a second occurrence
    e.saw([reading("")])
    e.saw([reading("8C03A000")])
    assert counts(e.counts.samples(), m.NPU_ERROR_CODES, "code") == {
        ("npu3-0", "A4025021"): 2, ("npu3-0", "8C03A000"): 2}


def test_the_npu_gauge_is_the_first_code_listed_now_as_a_number_zero_without():
    e = ErrorCodes(32)
    rs = [reading("8C084E00 A4025021", 0), reading("", 1), reading("junk!", 2)]
    e.saw(rs)
    gauge = {s.labels["device"]: s.value for s in e.samples(rs) if s.name == m.NPU_ERROR_CODE}
    assert gauge == {"npu3-0": float(0x8C084E00), "npu3-1": 0.0}   # no number for a token that is not hex
    assert counts(e.counts.samples(), m.NPU_ERROR_CODES, "code") == {
        ("npu3-0", "8C084E00"): 1, ("npu3-0", "A4025021"): 1, ("npu3-2", OTHER): 1}


def test_npu_codes_past_the_bound():
    e = ErrorCodes(1)
    e.saw([reading("A4025021 8C03A000 8C084E00")])
    out = e.counts.samples()
    assert counts(out, m.NPU_ERROR_CODES, "code") == {("npu3-0", "A4025021"): 1, ("npu3-0", OTHER): 2}
    assert over(out) == {"npu3-0": 2}


def test_npu_smi_source_counts_the_recorded_alarm_codes(tmp_path, monkeypatch):
    d = tmp_path / "scenario"
    shutil.copytree(FIXTURES / "scenario-8x910B4", d)
    monkeypatch.setenv("FAKE_NPU_SMI_DIR", str(d))
    for k in ("FAKE_NPU_SMI_DELAY_S", "FAKE_NPU_SMI_DELAY_ON", "FAKE_NPU_SMI_T0", "FAKE_NPU_SMI_NOW", "FAKE_NPU_SMI_LOG"):
        monkeypatch.delenv(k, raising=False)
    src = NpuSmiSource(path=str(FAKE), timeout_s=120.0, offline_timeout_s=120.0, error_codes_per_device=2)
    src.setup()
    try:
        first = src.collect(OFFLINE)
        assert counts(first, m.NPU_ERROR_CODES, "code") == {}
        assert {s.labels["device"]: s.value for s in first if s.name == m.NPU_ERROR_CODE} == {
            f"npu{n}-0": 0.0 for n in range(8)}
        shutil.copyfile(FIXTURES / "info-t-health-910A-2.txt", d / "health-3.txt")   # Alarm, three codes
        for _ in range(2):
            out = src.collect(OFFLINE)
        assert counts(out, m.NPU_ERROR_CODES, "code") == {
            ("npu3-0", "A4025021"): 1, ("npu3-0", "8C03A000"): 1, ("npu3-0", OTHER): 1}
        assert over(out) == {"npu3-0": 1}
        assert next(s.value for s in out if s.name == m.NPU_ERROR_CODE and s.labels["device"] == "npu3-0") == float(
            0xA4025021)
    finally:
        src.close()
