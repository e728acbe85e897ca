"""The fake NVML's per-process utilisation calls, through pynvml's own functions and raw ctypes:
samples since a timestamp, NOT_FOUND, the size handshake, the versioned struct, scenario errors."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time

from test_fake_nvml import PRELUDE, fakenvml, run_py, write

SCN = """
gpu_count = 1
[gpu 0]
gpu_util = 90
mem_util = 40
process_util_period_ms = 250
process = 3001 1GiB
process = 3002 1GiB
process = 3003 1GiB
process_util = 3001 30 10 0 5
process_util = 3002 50 20 7 0 0 1    # idle from t = 1
"""


def test_samples_since_a_timestamp_not_found_and_the_size_handshake(libdir, tmp_path):
    # Scenario second ~2.06 now: 3001 and 3003 sampled at t = 2.0, 3002 last at 0.75. t0 a whole
    # sixteenth of a second, so every stamp is a whole microsecond however the fake rounds.
    t0 = math.floor(time.time() * 16) / 16 - 2.0625
    out = run_py(libdir, write(tmp_path, "u.scn", SCN), """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        rows = lambda ss: sorted([s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil] for s in ss)
        out['newer'] = rows(nv.nvmlDeviceGetProcessesUtilizationInfo(h, 0))
        out['older'] = rows(nv.nvmlDeviceGetProcessUtilization(h, 0))
        newest = max(r[1] for r in out['newer'])
        out['since_newest'] = err(nv.nvmlDeviceGetProcessUtilization, h, newest)
        out['since_0.75'] = rows(nv.nvmlDeviceGetProcessUtilization(h, min(r[1] for r in out['newer'])))
        fn = nv._nvmlGetFunctionPointer('nvmlDeviceGetProcessUtilization')
        count = ctypes.c_uint(0)
        out['null'] = [fn(h, None, ctypes.byref(count), ctypes.c_ulonglong(0)), count.value]
        buf = (nv.c_nvmlProcessUtilizationSample_t * 1)()
        count = ctypes.c_uint(1)
        out['small'] = [fn(h, buf, ctypes.byref(count), ctypes.c_ulonglong(0)), count.value]
        info = nv.c_nvmlProcessesUtilizationInfo_v1_t(0)
        info.version = 0x2000018
        out['version'] = nv._nvmlGetFunctionPointer('nvmlDeviceGetProcessesUtilizationInfo')(h, ctypes.byref(info))
    """, t0=t0)
    us = lambda t: round((t0 + t) * 1e6)   # noqa: E731
    assert out["newer"] == [[3001, us(2.0), 30, 10, 0, 5], [3002, us(0.75), 50, 20, 7, 0], [3003, us(2.0), 90, 40, 0, 0]]
    assert out["older"] == out["newer"]
    assert out["since_newest"] == 6                                   # NOT_FOUND: nothing newer
    assert out["since_0.75"] == [r for r in out["newer"] if r[0] != 3002]   # strictly newer only
    assert out["null"] == [7, 3] and out["small"] == [7, 3]          # INSUFFICIENT_SIZE with the count needed
    assert out["version"] == 25                                       # ARGUMENT_VERSION_MISMATCH


def test_bad_process_util_lines_are_refused(libdir, tmp_path):
    code = PRELUDE + textwrap.dedent("""
        try:
            nv.nvmlInit(); out['init'] = 0
        except nv.NVMLError as e:
            out['init'] = e.value
        print('@@' + json.dumps(out))
    """)
    for line, why in (("process_util = 3001 30 10", "process_util = PID SM MEM ENC DEC"),
                      ("process_util = 3001 130 10 0 0", "process_util: utilisation must be 0-100 %")):
        scn = write(tmp_path, "bad.scn", f"gpu_count = 1\n[gpu 0]\n{line}\n")
        r = subprocess.run([sys.executable, "-c", code], env=fakenvml.env(libdir, scn), capture_output=True,
                           text=True, timeout=60)
        assert '"init": 999' in r.stdout and f"bad.scn:3: {why}" in r.stderr
