"""The fake libnvidia-ml.so.1 (tests/fakes/nvml): pynvml's real ctypes code against scenario files.

Every check runs pynvml in a fresh subprocess (fresh library state) with LD_LIBRARY_PATH pointing at
the fake; FAKE_NVML_T0 places the process on the scenario's timeline, so nothing sleeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes" / "nvml"))
import fakenvml  # noqa: E402

pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install nvidia-ml-py)")

MiB = 1 << 20
PRELUDE = """
import json, sys, ctypes
import pynvml as nv
out = {}
def err(fn, *a):
    try:
        fn(*a)
        return None
    except nv.NVMLError as e:
        return e.value
"""


@pytest.fixture(scope="module")
def libdir(tmp_path_factory):
    if fakenvml.compiler() is None:
        pytest.skip("no C compiler (cc) to build the fake libnvidia-ml; apt-get install gcc")
    return fakenvml.build(tmp_path_factory.mktemp("fake-nvml"))


def run_py(libdir, scenario, body: str, t: float | None = None, t0: float | None = None, **env_kw) -> dict:
    """Run PRELUDE + body under the fake, at scenario second `t` (or with FAKE_NVML_T0 = t0; neither:
    the clock starts at nvmlInit); the body fills `out`, which comes back parsed."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('@@' + json.dumps(out))\n"
    if t is not None:
        t0 = fakenvml.t0_at(t)
    env = fakenvml.env(libdir, scenario, t0=t0, **env_kw)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    line = [x for x in r.stdout.splitlines() if x.startswith("@@")][-1]
    return json.loads(line[2:])


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_build_is_reused_while_source_unchanged(libdir):
    lib = libdir / fakenvml.LIBNAME
    before = lib.stat().st_mtime_ns
    assert fakenvml.build(libdir) == libdir
    assert lib.stat().st_mtime_ns == before
    assert (libdir / "libnvidia-ml.so").resolve() == lib.resolve()


def test_h100x8_inventory(libdir):
    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        nv.nvmlInit()
        out['driver'] = nv.nvmlSystemGetDriverVersion()
        out['nvml'] = nv.nvmlSystemGetNVMLVersion()
        out['cuda'] = nv.nvmlSystemGetCudaDriverVersion_v2()
        n = nv.nvmlDeviceGetCount()
        out['count'] = n
        gpus = []
        for i in range(n):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = nv.nvmlDeviceGetPciInfo(h)
            m1 = nv.nvmlDeviceGetMemoryInfo(h)
            m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            gpus.append(dict(
                index=nv.nvmlDeviceGetIndex(h), name=nv.nvmlDeviceGetName(h), uuid=nv.nvmlDeviceGetUUID(h),
                serial=nv.nvmlDeviceGetSerial(h), bus=pci.busId, legacy=pci.busIdLegacy,  # str: pynvml decodes char arrays
                bus_no=pci.bus, pci_id=pci.pciDeviceId, arch=nv.nvmlDeviceGetArchitecture(h),
                cc=list(nv.nvmlDeviceGetCudaComputeCapability(h)), total=m1.total, used1=m1.used,
                free1=m1.free, total2=m2.total, reserved2=m2.reserved, used2=m2.used, free2=m2.free,
                mig=nv.nvmlDeviceGetMigMode(h), mig_max=nv.nvmlDeviceGetMaxMigDeviceCount(h),
                links=[nv.nvmlDeviceGetNvLinkState(h, l) for l in range(18)],
                link18=err(nv.nvmlDeviceGetNvLinkState, h, 18),
                gpm=nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice,
                limit=nv.nvmlDeviceGetEnforcedPowerLimit(h),
                ismig=nv.nvmlDeviceIsMigDeviceHandle(h).value))
        out['gpus'] = gpus
        out['bad_index'] = err(nv.nvmlDeviceGetHandleByIndex, 8)
        nv.nvmlShutdown()
    """)
    assert (out["driver"], out["nvml"], out["cuda"]) == ("550.54.15", "12.550.54.15", 12040)
    assert out["count"] == 8 and len(out["gpus"]) == 8
    assert out["bad_index"] == 2  # INVALID_ARGUMENT
    uuids = [g["uuid"] for g in out["gpus"]]
    assert uuids == [f"GPU-8a3b1c2d-4e5f-4a6b-9c7d-0e1f2a3b4c5{i}" for i in range(8)]
    assert [g["bus"] for g in out["gpus"]] == [f"00000000:{b}:00.0" for b in
                                               ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")]
    for i, g in enumerate(out["gpus"]):
        assert g["index"] == i
        assert g["name"] == "NVIDIA H100 80GB HBM3"
        assert g["legacy"] == g["bus"][4:] and g["bus_no"] == int(g["bus"][9:11], 16)
        assert g["pci_id"] == 0x233010DE
        assert (g["arch"], g["cc"]) == (9, [9, 0])
        assert g["total"] == g["total2"] == 81559 * MiB
        assert g["reserved2"] == 551 * MiB and g["used2"] == 64 * 1024 * MiB
        assert g["used1"] == g["used2"] + g["reserved2"] and g["free1"] == g["free2"]
        assert g["free2"] == g["total2"] - g["reserved2"] - g["used2"]
        assert g["mig"] == [0, 0] and g["mig_max"] == 7 and g["ismig"] == 0
        assert g["links"] == [1] * 18 and g["link18"] == 2
        assert g["gpm"] == 1 and g["limit"] == 700000


def test_a100_has_no_gpm(libdir):
    out = run_py(libdir, fakenvml.scenario("a100x4"), """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(3)
        out['count'] = nv.nvmlDeviceGetCount()
        out['name'] = nv.nvmlDeviceGetName(h)
        out['arch'] = nv.nvmlDeviceGetArchitecture(h)
        out['cc'] = list(nv.nvmlDeviceGetCudaComputeCapability(h))
        out['total'] = nv.nvmlDeviceGetMemoryInfo(h).total
        out['links'] = sum(nv.nvmlDeviceGetNvLinkState(h, l) for l in range(12))
        out['link12'] = err(nv.nvmlDeviceGetNvLinkState, h, 12)
        out['gpm'] = nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice
        s = nv.nvmlGpmSampleAlloc()
        out['sample'] = err(nv.nvmlGpmSampleGet, h, s)
        nv.nvmlGpmSampleFree(s)
        out['mem_util'] = nv.nvmlDeviceGetUtilizationRates(h).memory
        nv.nvmlShutdown()
    """, t=10.0)
    assert out["count"] == 4
    assert out["name"] == "NVIDIA A100-SXM4-40GB"
    assert (out["arch"], out["cc"]) == (7, [8, 0])
    assert out["total"] == 40960 * MiB
    assert out["links"] == 12 and out["link12"] == 2
    assert out["gpm"] == 0
    assert out["sample"] == 3  # NVML_ERROR_NOT_SUPPORTED -> pynvml.NVMLError_NotSupported
    assert 48 <= out["mem_util"] <= 49  # the memory-controller busy % still works (0:47 30:50 at t=10..11)


GPM_READ = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
nv.nvmlGpmSampleGet(h, s1)
err(nv.nvmlEventSetWait, nv.nvmlEventSetCreate(), 120)   # > 100 ms between samples (nvml.h)
nv.nvmlGpmSampleGet(h, s2)
mg = nv.c_nvmlGpmMetricsGet_t()
mg.version = nv.NVML_GPM_METRICS_GET_VERSION
mg.sample1, mg.sample2 = s1, s2
ids = [1, 2, 5, 10, 20, 21, 60, 61, 4]
mg.numMetrics = len(ids)
for i, m in enumerate(ids):
    mg.metrics[i].metricId = m
nv.nvmlGpmMetricsGet(mg)
out['m'] = {str(mg.metrics[i].metricId): [mg.metrics[i].nvmlReturn, mg.metrics[i].value] for i in range(len(ids))}
out['unit10'] = mg.metrics[3].metricInfo.unit.decode()
bad = nv.c_nvmlGpmMetricsGet_t(); bad.version = 7; bad.sample1, bad.sample2 = s1, s2
out['bad_version'] = err(nv.nvmlGpmMetricsGet, bad)
nv.nvmlGpmSampleFree(s1); nv.nvmlGpmSampleFree(s2)
nv.nvmlShutdown()
"""


@pytest.mark.parametrize("t,dram,sm", [(2.0, 40.0, 55.0), (8.0, 92.0, 61.0), (20.0, 40.0, 55.0)])
def test_gpm_dram_bw_util_follows_the_ramp(libdir, t, dram, sm):
    out = run_py(libdir, fakenvml.scenario("ramp"), GPM_READ, t=t)
    m = out["m"]
    assert m["10"][0] == 0 and m["10"][1] == pytest.approx(dram, abs=1e-6)
    assert m["2"][0] == 0 and m["2"][1] == pytest.approx(sm, abs=1e-6)
    assert m["60"][1] == pytest.approx(20000, abs=1e-3) and m["61"][1] == pytest.approx(20000, abs=1e-3)
    assert m["20"][1] == pytest.approx(400000 / 1024, abs=1e-6)
    assert m["4"][0] == 3  # a metric the fake does not model: per-metric NOT_SUPPORTED
    assert out["unit10"] == "%"
    assert out["bad_version"] == 25  # ARGUMENT_VERSION_MISMATCH


def test_gpm_metric_is_the_mean_between_samples(libdir, tmp_path):
    scn = write(tmp_path, "lin.scn", """
        gpu_count = 1
        [gpu 0]
        gpm = yes
        gpm_dram_bw_util = 0:0 100:100
    """)
    out = run_py(libdir, scn, """
        lib = ctypes.CDLL("libnvidia-ml.so.1"); lib.fakeNvmlNow.restype = ctypes.c_double
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        a = lib.fakeNvmlNow(); nv.nvmlGpmSampleGet(h, s1); b = lib.fakeNvmlNow()
        es = nv.nvmlEventSetCreate()
        # let scenario time pass by a real blocking call (no events: it times out)
        out['wait'] = err(nv.nvmlEventSetWait, es, 150)
        c = lib.fakeNvmlNow(); nv.nvmlGpmSampleGet(h, s2); d = lib.fakeNvmlNow()
        mg = nv.c_nvmlGpmMetricsGet_t(); mg.version = 1; mg.sample1, mg.sample2 = s1, s2
        mg.numMetrics = 1; mg.metrics[0].metricId = 10
        nv.nvmlGpmMetricsGet(mg)
        out.update(a=a, b=b, c=c, d=d, v=mg.metrics[0].value)
    """, t=30.0)
    assert out["wait"] == 10  # TIMEOUT
    # value(t) = t, so the mean over [t1, t2] is (t1 + t2) / 2, with t1 in [a, b] and t2 in [c, d]
    assert (out["a"] + out["c"]) / 2 <= out["v"] <= (out["b"] + out["d"]) / 2


def test_gpm_samples_under_100ms_apart_and_nan_metrics(libdir, tmp_path):
    scn = write(tmp_path, "gpm.scn", """
        gpu_count = 1
        [gpu 0]
        gpm = yes
        gpm_dram_bw_util = 50
        gpm_sm_util = 70
        gpm_short_value = 99
        gpm_nan = 10 5 6
    """)
    body = """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        es = nv.nvmlEventSetCreate()
        def pair(wait_ms):
            s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(h, s1)
            if wait_ms:
                err(nv.nvmlEventSetWait, es, wait_ms)
            nv.nvmlGpmSampleGet(h, s2)
            mg = nv.c_nvmlGpmMetricsGet_t(); mg.version = 1; mg.sample1, mg.sample2 = s1, s2
            mg.numMetrics = 2; mg.metrics[0].metricId = 10; mg.metrics[1].metricId = 2
            nv.nvmlGpmMetricsGet(mg)
            nv.nvmlGpmSampleFree(s1); nv.nvmlGpmSampleFree(s2)
            return [[mg.metrics[i].nvmlReturn, repr(mg.metrics[i].value)] for i in range(2)]
        out['close'] = pair(0)
        out['apart'] = pair(120)
    """
    early, nan = run_py(libdir, scn, body, t=1.0), run_py(libdir, scn, body, t=5.2)
    # Under 100 ms apart: success codes and made-up values (DCGM issue 310: invalid, no error).
    assert early["close"] == [[0, "99.0"], [0, "99.0"]]
    assert early["apart"] == [[0, "50.0"], [0, "70.0"]]
    # A NaN metric, also with a success code, in its window only.
    assert nan["apart"] == [[0, "nan"], [0, "70.0"]]


def test_nvlink_counters_scoped_and_rates(libdir, tmp_path):
    scn = write(tmp_path, "nvl.scn", """
        gpu_count = 1
        [gpu 0]
        nvlink_links = 4
        nvlink_max_links = 6
        nvlink_rx_mibps = 1000
        nvlink_tx_mibps = 3000
    """)
    t0 = fakenvml.t0_at(100.0)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        ALL = 0xFFFFFFFF
        def read():
            ids = [(139, ALL), (138, ALL)] + [(139, l) for l in range(6)] + [(138, 40), 139, 91, 90, (141, ALL)]
            return [[v.fieldId, v.scopeId, v.timestamp, v.nvmlReturn, v.valueType, v.value.ullVal, v.value.uiVal]
                    for v in nv.nvmlDeviceGetFieldValues(h, ids)]
        out['a'] = read()
        out['b'] = read()
        nv.nvmlShutdown()
    """, t0=t0)
    a, b = out["a"], out["b"]
    for snap in (a, b):
        ts = snap[0][2]
        t = ts / 1e6 - t0  # the scenario time at which the library took the values
        rx, tx = snap[0][5], snap[1][5]
        assert all(v[3] == 0 for v in snap[:8]) and snap[0][4] == 3  # SUCCESS, unsigned long long
        assert rx == pytest.approx(1000 * 1024 * t, abs=1100)  # KiB; timestamp is whole microseconds
        assert tx == pytest.approx(3000 * 1024 * t, abs=3200)
        per_link = [v[5] for v in snap[2:8]]
        assert per_link[4:] == [0, 0]  # links 4, 5 exist but are inactive
        assert sum(per_link) == pytest.approx(rx, abs=4)
        assert snap[8][3] == 2  # scope 40 is no link: INVALID_ARGUMENT
        assert snap[9][1] == 0 and snap[9][5] == per_link[0]  # a bare id means scope 0 = link 0
        assert (snap[10][6], snap[11][6]) == (4, 26562)
        assert snap[12][5] == pytest.approx(rx * 1.0625, abs=2)
    dt = (b[0][2] - a[0][2]) / 1e6
    assert b[0][5] >= a[0][5] and b[1][5] >= a[1][5]
    # the delta between two reads is the rate times the timestamps' difference (to rounding)
    assert b[0][5] - a[0][5] == pytest.approx(1000 * 1024 * dt, abs=3)
    assert b[1][5] - a[1][5] == pytest.approx(3000 * 1024 * dt, abs=8)


def test_h100_counters_increase(libdir):
    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        nv.nvmlInit()
        res = []
        for _ in range(2):
            row = []
            for i in range(8):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                f = nv.nvmlDeviceGetFieldValues(h, [(138, 0xFFFFFFFF), (139, 0xFFFFFFFF), 83, 82])
                row.append([f[0].value.ullVal, f[1].value.ullVal, f[2].value.ullVal, f[3].value.uiVal,
                            nv.nvmlDeviceGetTotalEnergyConsumption(h)])
            res.append(row)
        out['res'] = res
    """, t=45.0)
    first, second = out["res"]
    for g1, g2 in zip(first, second):
        assert g2[0] > g1[0] > 0 and g2[1] > g1[1] > 0  # NVLink TX / RX KiB keep growing
        assert g2[2] > g1[2] > 912345678  # energy mJ from energy_start_mj up
        assert 60 <= g1[3] <= 75  # HBM temperature from field 82
        assert g1[4] >= g1[2]


def test_energy_is_the_integral_of_power(libdir, tmp_path):
    scn = write(tmp_path, "pw.scn", """
        gpu_count = 1
        [gpu 0]
        energy_start_mj = 1000
        power_mw = 0:100000 10:300000
    """)
    t0 = fakenvml.t0_at(30.0)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        f = nv.nvmlDeviceGetFieldValues(h, [83, 186])
        out.update(ts=f[0].timestamp, e=f[0].value.ullVal, p=f[1].value.uiVal)
    """, t0=t0)
    t = out["ts"] / 1e6 - t0
    # 0..10 s: ramp 100 W -> 300 W = 2000 J; then 300 W
    assert out["e"] == pytest.approx(1000 + 2_000_000 + 300_000 * (t - 10), abs=400)
    assert out["p"] == 300000


def test_lost_gpu_after_t5_while_gpu0_works(libdir):
    scn = fakenvml.scenario("lost")
    before = run_py(libdir, scn, """
        nv.nvmlInit()
        out['names'] = [nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    """, t=1.0)
    assert before["names"] == ["NVIDIA H100 80GB HBM3"] * 2
    after = run_py(libdir, scn, """
        nv.nvmlInit()
        out['count'] = nv.nvmlDeviceGetCount()
        try:
            nv.nvmlDeviceGetHandleByIndex(1)
            out['lost'] = None
        except nv.NVMLError_GpuIsLost as e:
            out['lost'] = e.value
        h0 = nv.nvmlDeviceGetHandleByIndex(0)
        out['util0'] = nv.nvmlDeviceGetUtilizationRates(h0).gpu
        out['uuid0'] = nv.nvmlDeviceGetUUID(h0)
        out['by_uuid'] = err(nv.nvmlDeviceGetHandleByUUID, 'GPU-4c05d7e1-0000-4000-8000-000000000001')
    """, t=6.0)
    assert after["count"] == 2
    assert after["lost"] == 15
    assert after["util0"] == 86  # 0:80 10:90 at t=6
    assert after["uuid0"] == "GPU-4c05d7e1-0000-4000-8000-000000000000"
    assert after["by_uuid"] == 15


def test_held_handle_turns_lost(libdir, tmp_path):
    # an XID at the very moment of loss is the synchronisation point: after it, GPU 1 is gone
    scn = write(tmp_path, "lost5.scn", """
        gpu_count = 2
        event_delivery = all
        [gpu *]
        gpu_util = 50
        [gpu 1]
        lost_at = 5
        event = 5 xid 79
    """)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        es = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(h1, nv.nvmlEventTypeXidCriticalError, es)
        d = nv.nvmlEventSetWait(es, 20000)
        out['xid'] = d.eventData
        out['calls'] = [err(f, h1) for f in (nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetName,
                                              nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetPowerUsage,
                                              nv.nvmlDeviceGetComputeRunningProcesses)]
        out['fields'] = err(nv.nvmlDeviceGetFieldValues, h1, [83])
        out['gpu0'] = nv.nvmlDeviceGetUtilizationRates(h0).gpu
    """, t=4.7)
    assert out["xid"] == 79
    assert out["calls"] == [15] * 5 and out["fields"] == 15
    assert out["gpu0"] == 50


def test_xid_event_arrives_through_event_set(libdir):
    out = run_py(libdir, fakenvml.scenario("lost"), """
        nv.nvmlInit()
        es = nv.nvmlEventSetCreate()
        hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        for h in hs:
            mask = nv.nvmlDeviceGetSupportedEventTypes(h) & (nv.nvmlEventTypeXidCriticalError
                                                            | nv.nvmlEventTypeDoubleBitEccError)
            nv.nvmlDeviceRegisterEvents(h, mask, es)
        out['bad_mask'] = err(nv.nvmlDeviceRegisterEvents, hs[0], 1 << 40, es)
        d = nv.nvmlEventSetWait(es, 20000)   # the XID is due at t = 4.5; we start at t = 3.0
        out['event'] = [nv.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData, d.gpuInstanceId]
        out['again'] = err(nv.nvmlEventSetWait, es, 0)
        nv.nvmlEventSetFree(es)
        nv.nvmlShutdown()
    """, t=3.0)
    assert out["event"] == [1, 0x8, 79, 0xFFFFFFFF]
    assert out["again"] == 10  # TIMEOUT: delivered once
    assert out["bad_mask"] == 3


def test_events_before_registration_are_not_replayed(libdir):
    out = run_py(libdir, fakenvml.scenario("lost"), """
        nv.nvmlInit()
        es = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), 8, es)
        out['wait'] = err(nv.nvmlEventSetWait, es, 0)
    """, t=6.0)
    assert out["wait"] == 10


def test_processes_static_and_from_file(libdir, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        scn_dir = tmp_path / "scn"
        scn_dir.mkdir()
        scn = scn_dir / "ramp.scn"
        scn.write_text(fakenvml.scenario("ramp").read_text())
        (scn_dir / "ramp.procs").write_text(f"# gpu pid bytes\n0 {child.pid} {3 * 1024 * MiB}\n")
        out = run_py(libdir, scn, f"""
            nv.nvmlInit()
            h = nv.nvmlDeviceGetHandleByIndex(0)
            ps = nv.nvmlDeviceGetComputeRunningProcesses(h)
            out['first'] = [[p.pid, p.usedGpuMemory, p.gpuInstanceId] for p in ps]
            out['name'] = nv.nvmlSystemGetProcessName({child.pid})
            with open({str(scn_dir / 'ramp.procs')!r}, 'a') as f:
                f.write('0 777 1048576\\n1 778 5\\n')
            out['second'] = [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
            out['missing'] = err(nv.nvmlSystemGetProcessName, 999999999)
        """)
        assert out["first"] == [[child.pid, 3 * 1024 * MiB, 0xFFFFFFFF]]
        assert out["name"] == "python3" or out["name"].startswith("python")
        assert out["second"] == [[child.pid, 3 * 1024 * MiB], [777, MiB]]  # re-read on every call
        assert out["missing"] == 6  # NOT_FOUND

        env_procs = tmp_path / "env.procs"
        env_procs.write_text("0 4321 42\n")
        out = run_py(libdir, scn, """
            nv.nvmlInit()
            h = nv.nvmlDeviceGetHandleByIndex(0)
            out['p'] = [[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        """, procs=env_procs)
        assert out["p"] == [[4321, 42]]  # FAKE_NVML_PROCS overrides procs_file
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_driver_generations_process_entry_size_and_missing_symbols(libdir, tmp_path):
    # R535.43-535.86: 32-byte _v3 entries, no nvmlDeviceGetRunningProcessDetailList yet.
    scn = write(tmp_path, "r535.scn", """
        process_info_size = 32
        missing_symbols = nvmlDeviceGetRunningProcessDetailList
        gpu_count = 1
        [gpu 0]
        process = 3001 1GiB
        process = 3002 2GiB
        process = 3003 3GiB
    """)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out['pynvml'] = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        out['v2'] = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses_v2(h)]
        out['has_detail'] = hasattr(nv.nvmlLib, 'nvmlDeviceGetRunningProcessDetailList')
        out['has_cc'] = hasattr(nv.nvmlLib, 'nvmlDeviceGetConfComputeMemSizeInfo')
        out['detail'] = err(nv.nvmlDeviceGetRunningProcessDetailList, h, nv.nvmlProcessDetailList_v1, 0)
    """)
    # pynvml's 24-byte reading of 32-byte entries: what nvitop issues 75/88 saw.
    assert out["pynvml"] == [3001, 0, 4294967295]
    assert out["v2"] == [3001, 3002, 3003]
    assert out["has_detail"] is False and out["has_cc"] is True
    assert out["detail"] == 13   # FUNCTION_NOT_FOUND: the symbol is really absent
    # The newer call where present; a scenario whose symbols the library does not match is refused.
    full = write(tmp_path, "r550.scn", "gpu_count = 1\n[gpu 0]\nprocess = 3001 1GiB\n")
    out = run_py(libdir, full, """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out['pynvml'] = [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
        out['detail'] = [p.pid for p in nv.nvmlDeviceGetRunningProcessDetailList(h, nv.nvmlProcessDetailList_v1, 0)]
    """)
    assert out == {"pynvml": [3001], "detail": [3001]}
    r = subprocess.run([sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"], capture_output=True, text=True,
                       env={**fakenvml.env(libdir, full), "FAKE_NVML_SCENARIO": str(scn)})
    assert r.returncode != 0 and "missing_symbols 'nvmlDeviceGetRunningProcessDetailList'" in r.stderr


def test_h100_static_processes(libdir):
    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        nv.nvmlInit()
        out['p'] = [[[p.pid, p.usedGpuMemory] for p in nv.nvmlDeviceGetComputeRunningProcesses(
            nv.nvmlDeviceGetHandleByIndex(i))] for i in range(8)]
        out['name'] = nv.nvmlSystemGetProcessName(4242)
    """)
    assert out["p"] == [[[4242 + i, 63 * 1024 * MiB]] for i in range(8)]
    assert out["name"] == "python3"


def test_other_readings_h100(libdir):
    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(5)
        h2 = nv.nvmlDeviceGetHandleByIndex(2)
        out['pcie'] = [nv.nvmlDeviceGetPcieThroughput(h, 0), nv.nvmlDeviceGetPcieThroughput(h, 1)]
        out['clk'] = [nv.nvmlDeviceGetClockInfo(h, c) for c in range(4)]
        out['maxclk'] = [nv.nvmlDeviceGetMaxClockInfo(h, c) for c in range(4)]
        out['power'] = nv.nvmlDeviceGetPowerUsage(h)
        out['temp'] = [nv.nvmlDeviceGetTemperature(h, 0), nv.nvmlDeviceGetTemperatureV(h, 0)]
        out['reasons'] = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        out['ecc'] = [nv.nvmlDeviceGetTotalEccErrors(h2, 0, 0), nv.nvmlDeviceGetTotalEccErrors(h2, 0, 1),
                      nv.nvmlDeviceGetTotalEccErrors(h2, 1, 0)]
        out['remap'] = list(nv.nvmlDeviceGetRemappedRows(h))
        out['fan'] = err(nv.nvmlDeviceGetFanSpeed, h)
        out['unknown_field'] = nv.nvmlDeviceGetFieldValues(h, [999])[0].nvmlReturn
        out['missing_fn'] = err(nv.nvmlDeviceGetBoardId, h)
    """, t=28.0)
    # KB/s on keyframes 0:1.2e6 30:1.3e6 and 0:5.4e6 30:5.6e6, read at t = 28 plus start-up time (< 2 s)
    assert 1283333 <= out["pcie"][0] <= 1300000 and 5533333 <= out["pcie"][1] <= 5600000
    assert out["clk"] == [1980, 1980, 2619, 1545]
    assert out["maxclk"] == [1980, 1980, 2619, 1755]
    assert out["power"] == 699000  # GPU 5 power-capped between t=26 and t=31
    assert out["reasons"] == 0x4
    assert out["temp"][0] == out["temp"][1] and 62 <= out["temp"][0] <= 63  # 0:58 30:63
    assert out["ecc"] == [3, 15, 0]  # GPU 2: 3 corrected volatile since t=20, aggregate 15
    assert out["remap"] == [0, 0, 0, 0]
    assert out["fan"] == 3
    assert out["unknown_field"] == 3
    assert out["missing_fn"] == 13  # FUNCTION_NOT_FOUND: not in the fake


def test_mig_instances(libdir, tmp_path):
    scn = write(tmp_path, "mig.scn", """
        gpu_count = 1
        [gpu 0]
        name = NVIDIA H100 80GB HBM3
        gpm = yes
        mig_mode = 1
        mig = 1 20GiB 5GiB 2g.20gb
        mig = 2 40GiB 1GiB 3g.40gb
        gpm_sm_util = 33
    """)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        out['mode'] = nv.nvmlDeviceGetMigMode(h)
        out['util'] = err(nv.nvmlDeviceGetUtilizationRates, h)
        migs = []
        for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nv.NVMLError_NotFound:
                continue
            mem = nv.nvmlDeviceGetMemoryInfo(m)
            migs.append([nv.nvmlDeviceGetGpuInstanceId(m), mem.total, mem.used, nv.nvmlDeviceGetName(m),
                         nv.nvmlDeviceIsMigDeviceHandle(m).value,
                         nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m))])
        out['migs'] = migs
        s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmMigSampleGet(h, 2, s1)
        err(nv.nvmlEventSetWait, nv.nvmlEventSetCreate(), 120)   # > 100 ms apart
        nv.nvmlGpmMigSampleGet(h, 2, s2)
        mg = nv.c_nvmlGpmMetricsGet_t(); mg.version = 1; mg.sample1, mg.sample2 = s1, s2
        mg.numMetrics = 1; mg.metrics[0].metricId = 2
        nv.nvmlGpmMetricsGet(mg)
        out['mig_sm'] = mg.metrics[0].value
        out['bad_gi'] = err(nv.nvmlGpmMigSampleGet, h, 9, s1)
    """)
    GiB = 1024 * MiB
    assert out["mode"] == [1, 1]
    assert out["util"] == 3
    assert out["migs"] == [[1, 20 * GiB, 5 * GiB, "NVIDIA H100 80GB HBM3 MIG 2g.20gb", 1, 0],
                           [2, 40 * GiB, 1 * GiB, "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 1, 0]]
    assert out["mig_sm"] == pytest.approx(33)
    assert out["bad_gi"] == 2


def test_unsupported_and_injected_errors(libdir, tmp_path):
    scn = write(tmp_path, "inj.scn", """
        gpu_count = 2
        [gpu *]
        gpm = yes
        mem_temp_c = 70
        [gpu 1]
        unsupported = nvmlDeviceGetPowerUsage field:82 gpm:10
        error = nvmlDeviceGetTemperature NO_PERMISSION 0 100
        error = nvmlDeviceGetClockInfo 999 200
    """)
    out = run_py(libdir, scn, """
        nv.nvmlInit()
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        out['power'] = [err(nv.nvmlDeviceGetPowerUsage, h0), err(nv.nvmlDeviceGetPowerUsage, h1)]
        out['f82'] = [nv.nvmlDeviceGetFieldValues(h, [82])[0].nvmlReturn for h in (h0, h1)]
        out['temp'] = err(nv.nvmlDeviceGetTemperature, h1, 0)
        out['clock'] = err(nv.nvmlDeviceGetClockInfo, h1, 1)
        s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(h1, s1); nv.nvmlGpmSampleGet(h1, s2)
        mg = nv.c_nvmlGpmMetricsGet_t(); mg.version = 1; mg.sample1, mg.sample2 = s1, s2
        mg.numMetrics = 2; mg.metrics[0].metricId = 10; mg.metrics[1].metricId = 2
        nv.nvmlGpmMetricsGet(mg)
        out['gpm'] = [mg.metrics[0].nvmlReturn, mg.metrics[1].nvmlReturn]
        try:
            nv.nvmlDeviceGetTemperature(h1, 0)
        except nv.NVMLError_NoPermission as e:
            out['msg'] = str(e)
    """, t=50.0)
    assert out["power"] == [None, 3]
    assert out["f82"] == [0, 3]
    assert out["temp"] == 4
    assert out["clock"] is None  # only from t = 200
    assert out["gpm"] == [3, 0]
    assert out["msg"] == "Insufficient Permissions"


def test_init_errors_and_uninitialized(libdir, tmp_path):
    code = PRELUDE + textwrap.dedent("""
        try:
            nv.nvmlInit(); out['init'] = 0
        except nv.NVMLError as e:
            out['init'] = e.value
        print('@@' + json.dumps(out))
    """)
    env = fakenvml.env(libdir, tmp_path / "x.scn")
    del env["FAKE_NVML_SCENARIO"]
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout.split("@@")[1])["init"] == 9  # DRIVER_NOT_LOADED: no scenario

    bad = write(tmp_path, "bad.scn", "gpu_count = 1\n[gpu 0]\nnmae = oops\n")
    r = subprocess.run([sys.executable, "-c", code], env=fakenvml.env(libdir, bad), capture_output=True,
                       text=True, timeout=60)
    assert json.loads(r.stdout.split("@@")[1])["init"] == 999
    assert "bad.scn:3: unknown key 'nmae'" in r.stderr

    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        nv.nvmlInit(); nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        nv.nvmlShutdown()
        out['still'] = nv.nvmlDeviceGetCount()   # one reference left
        nv.nvmlShutdown()
        out['count'] = err(nv.nvmlDeviceGetCount)
        out['name'] = err(nv.nvmlDeviceGetName, h)
        out['shutdown'] = err(nv.nvmlShutdown)
        out['errstr'] = nv.nvmlErrorString(15)
    """)
    assert out["still"] == 8
    assert out["count"] == out["name"] == out["shutdown"] == 1  # UNINITIALIZED
    assert out["errstr"] == "GPU is lost"


def test_call_counts(libdir, tmp_path):
    calls = tmp_path / "calls.txt"
    out = run_py(libdir, fakenvml.scenario("a100x4"), """
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        lib.fakeNvmlCallCount.restype = ctypes.c_ulonglong
        lib.fakeNvmlCallCount.argtypes = [ctypes.c_char_p]
        nv.nvmlInit()
        for i in range(4):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            for _ in range(3):
                nv.nvmlDeviceGetUtilizationRates(h)
        out['util'] = lib.fakeNvmlCallCount(b"nvmlDeviceGetUtilizationRates")
        out['handle'] = lib.fakeNvmlCallCount(b"nvmlDeviceGetHandleByIndex_v2")
        out['none'] = lib.fakeNvmlCallCount(b"nvmlDeviceGetName")
        nv.nvmlShutdown()
    """, calls=calls)
    assert out == {"util": 12, "handle": 4, "none": 0}
    counts = fakenvml.read_calls(calls)
    assert counts["nvmlDeviceGetUtilizationRates"] == 12
    assert counts["nvmlInitWithFlags"] == 1 and counts["nvmlShutdown"] == 1
    assert counts["_total"] == 18


def test_wait_does_not_block_other_threads(libdir):
    out = run_py(libdir, fakenvml.scenario("h100x8"), """
        import threading
        nv.nvmlInit()
        es = nv.nvmlEventSetCreate()
        nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), 8, es)
        res = {}
        def waiter():
            res['r'] = err(nv.nvmlEventSetWait, es, 60000)
        th = threading.Thread(target=waiter)
        th.start()
        n = 0
        for _ in range(200):
            for i in range(8):
                nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i)); n += 1
        out['calls_done'] = n
        out['waiter_alive'] = th.is_alive()   # still blocked in its 60 s wait
        nv.nvmlShutdown()                      # ends the wait
        th.join(30)
        out['waiter_result'] = res.get('r')
    """)
    assert out["calls_done"] == 1600
    assert out["waiter_alive"] is True
    assert out["waiter_result"] == 1  # UNINITIALIZED


@pytest.mark.parametrize("name", ["h100x8", "a100x4", "lost", "ramp"])
def test_shipped_scenarios_parse(libdir, name):
    out = run_py(libdir, fakenvml.scenario(name), """
        nv.nvmlInit()
        out['n'] = nv.nvmlDeviceGetCount()
    """, t=0.0)
    assert out["n"] == {"h100x8": 8, "a100x4": 4, "lost": 2, "ramp": 1}[name]
