"""XID events as drivers send them, through pynvml's ctypes code and the fake:
severity by class (application errors are not GPU failures), 999 as unknown, MIG instance ids."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402


def test_xid_classes_severities_and_mig_instances(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(3) + """
[gpu 0]
event = 0.5 xid 13        # graphics engine exception: the application's fault
event = 0.6 xid 79        # fallen off the bus
event = 0.7 xid 999       # the driver could not tell which
event = 0.8 xid 43        # GPU stopped processing (a killed context)
event = 0.9 dbe
[gpu 1]
mig_mode = 1
mig = 1 40GiB 1GiB 3g.40gb
event = 0.6 xid 31 1 0    # MMU fault in GPU instance 1, compute instance 0
event = 0.7 xid 48        # double-bit ECC: the whole GPU
[gpu 2]
mig_mode = 1
mig_monitor = no
mig = 1 40GiB 1GiB 3g.40gb
event = 0.6 xid 31 1 0    # without the monitor capability an instance's event is not reported
event = 0.7 xid 94        # contained ECC error, the whole device: reported
""")
    out = drive(libdir, scn, "realtime", until_t=1.6)
    xids = [(e["device"], e["attributes"]["xid"], e["attributes"]["xid_class"], e["severity"],
             e["attributes"].get("mig_instance"), e["attributes"].get("compute_instance"))
            for e in out["events"] if e["type"] == "xid"]
    assert sorted(xids) == sorted([
        ("gpu0", "13", "application", "warning", None, None),
        ("gpu0", "79", "hardware", "critical", None, None),
        ("gpu0", "999", "unknown", "critical", None, None),
        ("gpu0", "43", "application", "warning", None, None),
        ("gpu1", "31", "application", "warning", "1", "0"),
        ("gpu1", "48", "hardware", "critical", None, None),
        ("gpu2", "94", "hardware", "critical", None, None),
    ])
    msg = next(e["message"] for e in out["events"] if e["type"] == "xid" and e["attributes"]["xid"] == "31")
    assert "MIG instance 1" in msg and "application error" in msg
    assert [e["severity"] for e in out["events"] if e["type"] == "ecc"] == ["critical"]


def test_a_lost_gpu_in_the_event_set_is_reported_once_and_the_others_events_still_come(libdir, tmp_path):
    # Once gpu1 is lost every nvmlEventSetWait answers GPU_IS_LOST (nvml.h): the thread must not log
    # that every second forever and deliver nothing else.
    scn = write_scenario(tmp_path, h100s(2) + """
[gpu 1]
lost_at = 1
[gpu 0]
event = 2.5 xid 48
""")
    out = drive(libdir, scn, "offline", gap_s=0.3, until_t=5.0)
    assert out["errors"] == []
    lost = [e for e in out["events"] if e["type"] == "health" and e["attributes"]["status"] == "lost"]
    assert [e["device"] for e in lost] == ["gpu1"]
    assert [(e["device"], e["attributes"]["xid"]) for e in out["events"] if e["type"] == "xid"] == [("gpu0", "48")]
    assert "event wait failed" not in out["stderr"]
    late = [r for r in out["rounds"] if r["st"] >= 1.5]
    assert late and all(set(pick(r, "hw.power")) == {"gpu0"} for r in late)
