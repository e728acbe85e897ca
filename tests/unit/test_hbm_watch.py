"""The HBM bandwidth watch's rule, job grouping and actions, on synthetic 1 s samples."""

from __future__ import annotations

import json
import os
import signal

from xpusense.agent.hbm_watch import METRIC, HbmWatch, Rule, group_jobs
from xpusense.agent.sources.base import Sample

S = 1_000_000_000


def samples(values, dev="gpu0", vendor="nvidia", start_s=100, step_s=1.0):
    """One sample per step; None is a missing sample."""
    out = []
    for i, v in enumerate(values):
        if v is not None:
            out.append(Sample(METRIC, v, "1", {"device": dev, "vendor": vendor}, time_ns=int((start_s + i * step_s) * S)))
    return out


TRAINER = 4242   # a process of the fake /proc below


def fake_process(proc, pid, started=1000, caught=(signal.SIGUSR1,), tgid=None):
    """/proc/PID of a fake /proc: its start time (stat field 22), the signals it catches (SigCgt)."""
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    mask = sum(1 << (s - 1) for s in caught)
    (d / "status").write_text(f"Name:\ttrainer\nTgid:\t{tgid or pid}\nPid:\t{pid}\nSigCgt:\t{mask:016x}\n")
    (d / "stat").write_text(f"{pid} (my trainer) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 "
                            f"{started} 1000 10 0\n")


def make(tmp_path, procs=None, rules=None, actions=("file", "event"), kill=None, live=None):
    """A watch over a fake /proc in which the pids of `procs` (or `live`) exist, and catch SIGUSR1."""
    procs = procs if procs is not None else {TRAINER: {"gpu0"}}
    proc = tmp_path / "proc"
    for pid in (live if live is not None else procs):
        fake_process(proc, pid)
    proc.mkdir(parents=True, exist_ok=True)
    sent_signals = []
    w = HbmWatch(rules or {"default": Rule()}, lambda: procs, actions=actions, request_dir=str(tmp_path / "req"),
                 group_by="pid", proc=str(proc), kill=kill or (lambda pid, sig: sent_signals.append((pid, sig))))
    return w, sent_signals


def feed(w, ss):
    fired_at = []
    for s in ss:
        evs = w.observe([s])
        fired_at += [(s.time_ns // S, e) for e in evs]
    return fired_at


def test_fires_once_after_the_window_at_or_above_the_threshold(tmp_path):
    w, _ = make(tmp_path)
    # 0.85 exactly counts as "at or above"; crossed at t=102, window 5 s -> fires at t=107.
    fired = feed(w, samples([0.4, 0.5, 0.85, 0.9, 0.92, 0.92, 0.92, 0.92, 0.92, 0.92, 0.92]))
    assert [t for t, _ in fired] == [107]
    ev = fired[0][1]
    assert ev.type == "checkpoint_request" and ev.device == "gpu0"
    assert ev.attributes["pids"] == str(TRAINER) and ev.attributes["threshold"] == "0.85"
    req = json.loads((tmp_path / "req" / f"{ev.id}.json").read_text())
    assert req["accelerator"] == "gpu0" and req["value"] == 0.92 and req["window_s"] == 5.0
    assert req["crossed_time"] == 102.0 and req["pids"] == [TRAINER]


def test_a_dip_below_the_threshold_inside_the_window_restarts_it(tmp_path):
    w, _ = make(tmp_path)
    # above from 101, dips below the lower mark at 104 for one second, above again from 105
    fired = feed(w, samples([0.4, 0.9, 0.9, 0.9, 0.7, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]))
    assert [t for t, _ in fired] == [110]


def test_missing_samples_are_not_below_the_threshold(tmp_path):
    w, _ = make(tmp_path)
    fired = feed(w, samples([0.9, 0.9, None, None, 0.9, 0.9, 0.9]))
    assert [t for t, _ in fired] == [105]


def test_a_gap_longer_than_the_window_starts_the_window_again(tmp_path):
    w, _ = make(tmp_path)
    fired = feed(w, samples([0.9, 0.9] + [None] * 6 + [0.9] * 7))
    # last known above at 101; next sample at 108, 7 s later: window restarts at 108 -> fires at 113
    assert [t for t, _ in fired] == [113]


def test_rearms_only_below_the_lower_mark_and_cooldown_per_job(tmp_path):
    w, _ = make(tmp_path, rules={"default": Rule(window_s=2, cooldown_s=20)})
    seq = [0.9, 0.9, 0.9,        # fires at 102
           0.8, 0.9, 0.9, 0.9,   # 0.8 is below the threshold but above the lower mark: not re-armed
           0.5,                  # re-armed at 107
           0.9, 0.9, 0.9,        # would fire at 110: inside the job's 20 s cooldown -> nothing
           0.5] + [0.5] * 10 + [0.9, 0.9, 0.9]   # 122..: cooldown over -> fires at 124
    fired = feed(w, samples(seq))
    assert [t for t, _ in fired] == [102, 124]
    assert w.suppressed == 1 and w.fired == 2


def test_per_vendor_rules(tmp_path):
    w, _ = make(tmp_path, procs={101: {"gpu0"}, 102: {"npu0-0"}},
                rules={"default": Rule(threshold=0.85, window_s=2), "nvidia": Rule(threshold=0.7, window_s=2)})
    fired = feed(w, samples([0.75] * 4, "gpu0", "nvidia") + samples([0.75] * 4, "npu0-0", "huawei"))
    assert [(t, e.device) for t, e in fired] == [(102, "gpu0")]


def test_signal_action_reaches_every_process_of_the_job_once(tmp_path):
    w, sent = make(tmp_path, procs={11: {"gpu0"}, 12: {"gpu0", "gpu1"}, 13: {"gpu1"}}, actions=("signal",))
    w.group_by = "pid"
    feed(w, samples([0.9] * 7))
    assert sorted(sent) == [(11, signal.SIGUSR1), (12, signal.SIGUSR1)]
    assert {r.job for r in w.sent} == {"pid:11", "pid:12"}


def test_no_process_on_the_accelerator_sends_nothing(tmp_path):
    w, sent = make(tmp_path, procs={})
    assert feed(w, samples([0.9] * 7)) == [] and sent == []


def test_jobs_group_by_process_group_and_container_cgroup(tmp_path):
    proc = tmp_path / "proc"
    for pid, cg in ((100, "0::/kubepods.slice/pod-a/cri-containerd-1.scope"),
                    (101, "0::/kubepods.slice/pod-a/cri-containerd-1.scope"),
                    (102, "0::/kubepods.slice/pod-b/cri-containerd-2.scope")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(cg + "\n")
    jobs = group_jobs([100, 101, 102], "auto", str(proc))
    assert jobs == {"cgroup:/kubepods.slice/pod-a/cri-containerd-1.scope": [100, 101],
                    "cgroup:/kubepods.slice/pod-b/cri-containerd-2.scope": [102]}
    # Outside containers and services (a login session's cgroup), the process group.
    me = os.getpid()
    (proc / str(me)).mkdir()
    (proc / str(me) / "cgroup").write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    assert group_jobs([me], "auto", str(proc)) == {f"pgid:{os.getpgid(0)}": [me]}
    assert group_jobs([me], "cgroup", str(proc)) == {"cgroup:/user.slice/user-0.slice/session-1.scope": [me]}


def test_a_round_stamped_a_little_early_still_completes_the_window(tmp_path):
    w, _ = make(tmp_path)
    ss = samples([0.9] * 7)
    ss[5].time_ns -= 2_000_000  # the sample due 5 s after the crossing lands 2 ms early
    assert [t for t, _ in feed(w, ss)] == [104]  # its integer second is 104.998 -> fires there, not a round later


def test_nan_and_values_that_are_not_ratios_are_missing_samples_never_high_ones(tmp_path):
    # NaN compares false with everything: read as "not below the threshold" it would fire after 5 s.
    w, _ = make(tmp_path)
    bad = [float("nan"), float("inf"), -0.5, 1.7, float("nan"), float("nan"), float("nan"), float("nan")]
    assert feed(w, samples([0.5] + bad)) == []
    assert w.fired == 0 and w.ignored == len(bad)
    # A real crossing after them is timed from its own first sample, not from the NaNs'.
    later = samples([0.9] * 6, start_s=200)
    assert [t for t, _ in feed(w, later)] == [205]


def test_impossible_pids_from_a_vendor_library_are_never_signalled(tmp_path):
    # What a misread NVML process list gives (0, all-ones), init, the agent itself, a pid that ended.
    bad = {0: {"gpu0"}, 4294967295: {"gpu0"}, 1: {"gpu0"}, os.getpid(): {"gpu0"}, 31337: {"gpu0"}, -5: {"gpu0"}}
    w, sent = make(tmp_path, procs={**bad, TRAINER: {"gpu0"}}, actions=("signal", "file", "event"),
                   live=[TRAINER, 1, os.getpid()])
    fired = feed(w, samples([0.9] * 7))
    assert sent == [(TRAINER, signal.SIGUSR1)]
    assert [json.loads(p.read_text())["pids"] for p in (tmp_path / "req").glob("*.json")] == [[TRAINER]]
    assert [e.attributes["pids"] for _, e in fired] == [str(TRAINER)]
    assert w.bad_pids == len(bad)
    # Only impossible pids: no request at all (and os.getpgid never sees 4294967295).
    w, sent = make(tmp_path / "2", procs=bad, actions=("signal", "file", "event"), live=[1, os.getpid()])
    assert feed(w, samples([0.9] * 7)) == [] and sent == [] and w.fired == 0


def test_each_mig_instance_has_its_own_window_and_its_own_jobs(tmp_path):
    procs = {501: {"gpu0", "gpu0/gi1"}, 502: {"gpu0", "gpu0/gi2"}}
    w, sent = make(tmp_path, procs=procs, actions=("signal", "event"))

    def mig(values, gi):
        ss = samples(values)
        for s in ss:
            s.labels["mig_instance"] = str(gi)
        return ss
    # Instance 1 is high, instance 2 low, in the same rounds of the same GPU.
    fired = feed(w, [s for pair in zip(mig([0.9] * 7, 1), mig([0.2] * 7, 2)) for s in pair])
    assert [(t, e.device) for t, e in fired] == [(105, "gpu0/gi1")]
    assert sent == [(501, signal.SIGUSR1)]
