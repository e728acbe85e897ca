"""The training-side helper: a signal and its request file are one request, taken at a safe point."""

from __future__ import annotations

import json
import os
import signal

from helpers import wait_until

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
