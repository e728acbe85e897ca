"""cpu_starvation end to end: a job process and CPU hogs pinned to one CPU in a cgroup of
the test's own, the runqlat probe loaded for real, its histograms fed to the Diagnoser on a
simulated clock (5 s a collection, so a 60 s window takes a dozen collections, not a minute); the
diagnosis names the job's cgroup and pid, and closes once the hogs are gone."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ebpf_support import own_cgroup, probe_sources
from helpers import wait_until

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.cpu_starvation import RUNQUEUE_LATENCY, CpuStarvation
from xpusense.agent.sources.base import NEARLINE

pytestmark = pytest.mark.privileged

S = 1_000_000_000
STEP_S = 5
HOGS = 6
JOB = "import time\nwhile True:\n    time.sleep(0.001)\n"
HOG = "while True:\n    pass\n"


@pytest.fixture
def runqlat():
    with probe_sources({"probes": ["runqlat"]}) as [src]:
        yield src


@pytest.fixture
def job_cgroup():
    with own_cgroup("starve", "runqlat keys by cgroup v2 id") as path:
        yield path


def start(code: str, cgroup: Path, cpu: int) -> subprocess.Popen:
    def enter():
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        os.sched_setaffinity(0, {cpu})
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=enter)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)


def test_cpu_hogs_in_a_jobs_cgroup_open_cpu_starvation_and_closing_follows_their_end(runqlat, job_cgroup):
    cpu = min(os.sched_getaffinity(0))
    label = "/" + job_cgroup.name
    job = start(JOB, job_cgroup, cpu)
    hogs = [start(HOG, job_cgroup, cpu) for _ in range(HOGS)]
    d = Diagnoser([CpuStarvation(Context(processes=lambda: {job.pid: {"gpu0"}}), p99_above_ms=5,
                                 clear_below_ms=2.5, window_s=60, min_waits=50)],
                  open_after_s=30, close_after_s=60, check_every_s=STEP_S)
    clock = [1_800_000_000 * S]
    events: list = []

    def step(state: str):
        """One collection at the next simulated step; the events of `state` seen so far."""
        clock[0] += STEP_S * S
        samples = [dataclasses.replace(s, time_ns=clock[0]) for s in runqlat.collect(NEARLINE)
                   if s.name == RUNQUEUE_LATENCY]
        events.extend(d.observe(samples))
        return [e for e in events if e.attributes["diagnosis.state"] == state]

    try:
        [opened] = wait_until(lambda: step("open"), what=f"cpu_starvation to open for {label}")
        assert opened.device == "gpu0" and opened.attributes["diagnosis.rule"] == "cpu_starvation"
        assert opened.attributes["cgroup"] == label and opened.attributes["process.pid"] == str(job.pid)
        [ev] = json.loads(opened.attributes["diagnosis.evidence"])
        assert ev["series"] == RUNQUEUE_LATENCY and ev["labels"] == {"cgroup": label}
        assert "p99" in opened.attributes["diagnosis.cause"] and label in opened.attributes["diagnosis.cause"]
        # the p99 shown is above the threshold: six hogs take turns of a tick or more on one CPU
        p99_ms = float(opened.attributes["diagnosis.cause"].split("p99 ")[1].split(" ms")[0])
        assert p99_ms > 5, opened.attributes["diagnosis.cause"]
        stop(hogs)
        os.sched_setaffinity(job.pid, os.sched_getaffinity(0))   # the job alone, free to run anywhere
        [closed] = wait_until(lambda: step("closed"), what=f"cpu_starvation for {label} to close")
        assert closed.attributes["diagnosis.id"] == opened.attributes["diagnosis.id"]
        assert closed.attributes["cgroup"] == label and d.open_now() == []
        assert [e.attributes["diagnosis.state"] for e in events] == ["open", "closed"]
    finally:
        stop(hogs + [job])
