"""Who the HBM watch's signal reaches, on real processes and the real /proc: only a process that
catches the signal and is still the one listed, never the agent (here: this test process) or a
thread of it; and the request directory and files, which no other user can redirect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from helpers import wait_until

from xpusense.agent import proc_signal
from xpusense.agent.hbm_watch import METRIC, HbmWatch, Rule
from xpusense.agent.request_dir import RequestDirError
from xpusense.agent.sources.base import Sample

S = 1_000_000_000
# A child that notes each SIGUSR1 and SIGUSR2 in a file once its handlers are in place.
WITH_HANDLER = ("import signal, sys, time\n"
                "for s in (signal.SIGUSR1, signal.SIGUSR2):\n"
                "    signal.signal(s, lambda n, f: open(sys.argv[1], 'a').write(signal.Signals(n).name + '\\n'))\n"
                "open(sys.argv[1], 'a').close()\n"
                "time.sleep(600)\n")
WITHOUT_HANDLER = "import sys, time\nopen(sys.argv[1], 'a').close()\ntime.sleep(600)\n"


def no_sigusr1_arrived(pid, log) -> bool:
    """Whether `pid` (WITH_HANDLER) has had no SIGUSR1: a SIGUSR2 is sent and waited for; Python
    runs pending handlers in signal-number order, so a SIGUSR1 sent before it is noted first."""
    os.kill(pid, signal.SIGUSR2)
    wait_until(lambda: "SIGUSR2" in log.read_text(), what="the SIGUSR2 handler")
    return "SIGUSR1" not in log.read_text()


def high(window=5, dev="gpu0"):
    return [Sample(METRIC, 0.95, "1", {"device": dev, "vendor": "nvidia"}, time_ns=(100 + i) * S)
            for i in range(window + 2)]


@pytest.fixture
def child(tmp_path):
    """Start a real python child (WITH_HANDLER or WITHOUT_HANDLER); returns (Popen, its log path)."""
    started = []

    def start(code, name):
        log = tmp_path / f"{name}.log"
        p = subprocess.Popen([sys.executable, "-c", code, str(log)])
        started.append(p)
        wait_until(log.exists, what=f"{name} to start")
        return p, log
    yield start
    for p in started:
        p.kill()
        p.wait()


def watch(tmp_path, procs, actions=("signal", "file", "event")):
    return HbmWatch({"default": Rule()}, lambda: procs, actions=actions, request_dir=str(tmp_path / "req"),
                    group_by="pid")


def test_a_process_without_a_handler_gets_the_file_and_event_never_the_signal(tmp_path, child):
    plain, _ = child(WITHOUT_HANDLER, "server")          # an inference server: SIGUSR1 would end it
    trainer, got = child(WITH_HANDLER, "trainer")
    w = watch(tmp_path, {plain.pid: {"gpu0"}, trainer.pid: {"gpu0"}})
    events = [e for s in high() for e in w.observe([s])]
    wait_until(lambda: "SIGUSR1" in got.read_text(), what="the trainer's handler to run")
    assert plain.poll() is None, f"the process without a handler exited {plain.returncode}"
    assert w.status()["not_signalled"] == {"no_handler": 1}
    by_job = {e.attributes["job"]: e.attributes["actions"] for e in events}
    assert f"not signalled: {plain.pid} (no_handler)" in by_job[f"pid:{plain.pid}"]
    assert f"SIGUSR1 to pids [{trainer.pid}]" in by_job[f"pid:{trainer.pid}"]
    files = [json.loads(p.read_text())["pids"] for p in (tmp_path / "req").glob("*.json")]
    assert sorted(files) == sorted([[plain.pid], [trainer.pid]])   # both jobs get their request file


def test_a_thread_of_the_agent_in_the_process_list_is_never_signalled(tmp_path):
    """This test process plays the agent: it catches SIGUSR1 (so only the thread check stands
    between it and the signal), and one of its threads' ids is in the vendor's process list."""
    got = []
    previous = {s: signal.signal(s, lambda signum, _f: got.append(signum)) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    ready, stop = threading.Event(), threading.Event()
    tids = []
    t = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), ready.set(), stop.wait(60)))
    t.start()
    try:
        ready.wait(30)
        tid = tids[0]
        assert tid != os.getpid() and os.path.isdir(f"/proc/{tid}")
        w = watch(tmp_path, {tid: {"gpu0"}}, actions=("signal", "event"))
        for s in high():
            w.observe([s])
        # SIGUSR2 to ourselves: a SIGUSR1 sent before it would be handled first (lower number).
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(lambda: signal.SIGUSR2 in got, what="our own SIGUSR2")
        assert signal.SIGUSR1 not in got
        assert w.status()["not_signalled"] == {"agent": 1} and w.fired == 0
    finally:
        stop.set()
        t.join()
        for s, h in previous.items():
            signal.signal(s, h)


def test_a_pid_that_names_another_process_than_the_one_listed_is_not_signalled(tmp_path, child, monkeypatch):
    """The process list named pid P, started at tick T; when the signal is due, P started at
    another tick (the listed process ended and its pid was reused)."""
    proc, got = child(WITH_HANDLER, "newcomer")
    real = proc_signal.start_time
    reads = []

    def start_time(pid, proc="/proc"):
        reads.append(pid)
        t = real(pid, proc)
        return t - 250 if len(reads) == 1 and t is not None else t   # the listed one: 2.5 s older
    monkeypatch.setattr(proc_signal, "start_time", start_time, raising=False)
    w = watch(tmp_path, {proc.pid: {"gpu0"}}, actions=("signal", "event"))
    events = [e for s in high() for e in w.observe([s])]
    assert no_sigusr1_arrived(proc.pid, got)
    assert w.status()["not_signalled"] == {"pid_reused": 1}
    assert f"not signalled: {proc.pid} (pid_reused)" in events[0].attributes["actions"]


def boot_ticks() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")


def reuse(pid, log):
    """A new process (catching SIGUSR1) made to get `pid`, which must be free (ns_last_pid)."""
    for _ in range(100):   # another process on the machine may take the pid first: again
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen([sys.executable, "-c", WITH_HANDLER, str(log)])
        if p.pid == pid:
            wait_until(log.exists, what="the process with the reused pid")
            return p
        p.kill()
        p.wait()
    pytest.skip(f"pid {pid} was taken by another process 100 times")


@pytest.mark.parametrize("pidfd", [True, False])
def test_a_pid_really_reused_is_not_signalled(tmp_path, pidfd):
    """A real reuse: a listed process ends, another is made to get its pid (ns_last_pid, root only).
    With a pidfd opened when the list was read, even a reuse within the same clock tick is refused;
    without one, the start time refuses it once the tick has moved on."""
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root to set ns_last_pid")
    first = subprocess.Popen([sys.executable, "-c", WITH_HANDLER, str(tmp_path / "first.log")])
    wait_until((tmp_path / "first.log").exists, what="the listed process")
    pid = first.pid
    listed = proc_signal.record([pid], pidfds=pidfd)
    second = None
    try:
        first.kill()
        first.wait()
        if not pidfd:
            wait_until(lambda: boot_ticks() > listed[pid].started + 2, what="the next clock tick")
        second = reuse(pid, tmp_path / "second.log")
        refusal = proc_signal.send(pid, signal.SIGUSR1, listed[pid])
        assert refusal is not None and refusal[0] in (("pid_reused", "ended") if pidfd else ("pid_reused",))
        assert no_sigusr1_arrived(pid, tmp_path / "second.log")
        # Listed as itself: sent.
        again = proc_signal.record([pid], pidfds=pidfd)
        assert proc_signal.send(pid, signal.SIGUSR1, again[pid]) is None
        proc_signal.release(again)
        wait_until(lambda: "SIGUSR1" in (tmp_path / "second.log").read_text(), what="the handler")
    finally:
        proc_signal.release(listed)
        if second is not None:
            second.kill()
            second.wait()


def test_the_temporary_file_swapped_for_a_symlink_never_changes_its_target(tmp_path, monkeypatch, child):
    """Another user who can write request_dir replaces the agent's temporary file with a symlink
    to a root-only file right after it is created: the mode is set on the agent's own descriptor,
    the swap is seen, and nothing is written through the link."""
    secret = tmp_path / "shadow"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    job, _ = child(WITHOUT_HANDLER, "job")
    real = tempfile.mkstemp

    def mkstemp_then_swap(*a, **kw):
        fd, tmp = real(*a, **kw)
        os.unlink(tmp)
        os.symlink(secret, tmp)
        return fd, tmp
    w = watch(tmp_path, {job.pid: {"gpu0"}}, actions=("file", "event"))
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_swap)
    events = [e for s in high() for e in w.observe([s])]
    assert oct(secret.stat().st_mode & 0o7777) == oct(0o600) and secret.read_text() == "root only\n"
    assert not [p for p in (tmp_path / "req").iterdir() if p.is_symlink()]
    assert "file " not in events[0].attributes["actions"]


@pytest.mark.parametrize("mode,ok", [(0o777, False), (0o775, False), (0o1777, True), (0o755, True)])
def test_request_dir_writable_by_others_without_the_sticky_bit_is_refused(tmp_path, mode, ok):
    d = tmp_path / "req"
    d.mkdir()
    d.chmod(mode)
    if ok:
        watch(tmp_path, {})
        return
    with pytest.raises(RequestDirError) as e:
        watch(tmp_path, {})
    assert str(d) in str(e.value) and f"mode {mode:04o}" in str(e.value) and "sticky" in str(e.value)


def test_request_dir_that_is_a_symlink_or_another_users_is_refused_and_a_missing_one_made_1777(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "req").symlink_to(real)
    with pytest.raises(RequestDirError, match="is a symlink"):
        watch(tmp_path, {})
    (tmp_path / "req").unlink()
    if os.geteuid() == 0:
        real.rename(tmp_path / "req")
        os.chown(tmp_path / "req", 12345, 12345)
        with pytest.raises(RequestDirError, match="owned by uid 12345"):
            watch(tmp_path, {})
        (tmp_path / "req").rmdir()
    watch(tmp_path / "new", {})
    assert oct((tmp_path / "new/req").stat().st_mode & 0o7777) == oct(0o1777)
