"""The training-side helper: a signal and its request file are one request, taken at a safe point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from helpers import wait_until

from xpusense.agent.request_dir import prepare_request_dir, write_atomically
from xpusense.client.checkpoint import CheckpointRequests


def write_request(d, rid, pids):
    (d / f".{rid}.tmp").write_text(json.dumps({"id": rid, "accelerator": "gpu0", "pids": pids}))
    os.replace(d / f".{rid}.tmp", d / f"{rid}.json")


def test_signal_with_file_is_one_request(tmp_path):
    with CheckpointRequests(str(tmp_path), signal.SIGUSR2, poll_s=60) as req:  # the watcher stays out of it
        write_request(tmp_path, "r1", [os.getpid()])
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(req.pending, what="the signal to set the flag")
        got = req.take()
        assert got["id"] == "r1"
        assert not req.pending() and req.take() == {}
        req.done(got, path="ckpt")
        assert json.loads((tmp_path / "r1.done.json").read_text())["path"] == "ckpt"


def test_file_only_request_is_noticed_by_the_watcher(tmp_path):
    with CheckpointRequests(str(tmp_path), None, poll_s=0.02) as req:
        write_request(tmp_path, "other", [1])          # another job's request: not ours
        write_request(tmp_path, "mine", [os.getpid()])
        wait_until(req.pending, what="the watcher to see the file")
        assert req.take()["id"] == "mine"
        assert not req.pending()


def test_requests_from_before_start_are_ignored(tmp_path):
    write_request(tmp_path, "old", [os.getpid()])
    with CheckpointRequests(str(tmp_path), None, poll_s=0.02) as req:
        write_request(tmp_path, "new", [os.getpid()])
        wait_until(req.pending, what="the new request")
        assert req.take()["id"] == "new" and not req.pending()


def test_at_safe_point_calls_the_function_once(tmp_path):
    calls = []
    with CheckpointRequests(None, signal.SIGUSR2) as req:
        assert req.at_safe_point(calls.append) is False
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(req.pending, what="the signal")
        assert req.at_safe_point(calls.append) is True
        assert req.at_safe_point(calls.append) is False
    assert calls == [{}]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the previous handler is back


def test_a_signal_after_its_file_was_taken_is_not_a_second_request(tmp_path):
    """The watcher thread may read the request file before the agent's signal lands; that signal
    belongs to the request already taken (the file says a signal comes with it)."""
    with CheckpointRequests(str(tmp_path), signal.SIGUSR2, poll_s=0.02) as req:
        (tmp_path / ".r1.tmp").write_text(json.dumps({"id": "r1", "pids": [os.getpid()], "signal": "SIGUSR2"}))
        os.replace(tmp_path / ".r1.tmp", tmp_path / "r1.json")
        wait_until(req.pending, what="the watcher to see the file")
        assert req.take()["id"] == "r1"
        os.kill(os.getpid(), signal.SIGUSR2)   # the agent's signal, late
        wait_until(lambda: req._signals == 1, what="the signal to land")
        assert not req.pending() and not req.pending()
        # A signal of its own (no file) is still a request.
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(req.pending, what="the bare signal")
        assert req.take() == {} and not req.pending()


JOB = """
import json, os, sys
from xpusense.client.checkpoint import CheckpointRequests
os.setgroups([]); os.setgid(65534); os.setuid(65534)   # python itself lies under /root (0700): started as root
with CheckpointRequests(sys.argv[1], None, poll_s=0.02, pids={4242}) as req:
    print("ready", flush=True)
    while not req.pending():
        req._stop.wait(0.02)
    got = req.take()
    req.done(got, path="ckpt")
    print(json.dumps(got), flush=True)
"""


def test_a_job_of_another_user_takes_only_the_agents_request_and_writes_done_beside_it(tmp_path):
    """The request dir as the agent makes it (1777): a job running as `nobody` takes the agent's
    request, not one another user put there, and records it done."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the job as another user")
    top = tempfile.mkdtemp(prefix="xps-req-")   # pytest's own tmp dirs are 0700: nobody could enter
    try:
        os.chmod(top, 0o755)
        d = os.path.join(top, "checkpoint")
        assert prepare_request_dir(d) is None
        job = subprocess.Popen([sys.executable, "-c", JOB, d], stdout=subprocess.PIPE, text=True)
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        forged = os.open(os.path.join(d, "a-forged.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(forged, json.dumps({"id": "forged", "pids": [4242]}).encode())
        os.fchown(forged, 65533, 65533)   # another user of the node
        os.close(forged)
        write_atomically(d, "r1.json", {"id": "r1", "pids": [4242]})   # the agent's
        out, _ = job.communicate(timeout=60)
        assert json.loads(out)["id"] == "r1"
        done = os.path.join(d, "r1.done.json")
        assert os.stat(done).st_uid == 65534 and json.load(open(done))["path"] == "ckpt"
    finally:
        shutil.rmtree(top)
