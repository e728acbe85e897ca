"""Receive xpusense checkpoint requests inside a training job. Standard library only: import it
as `xpusense.client.checkpoint`, or copy this one file next to the training code.

The xpusense agent asks a job to checkpoint when the HBM bandwidth of its accelerator stays high
(README, "HBM bandwidth watch"), by a signal (default SIGUSR1), a JSON request file, or both;
CheckpointRequests turns either into a flag that the training loop checks at a safe point."""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

DEFAULT_DIR = os.environ.get("XPUSENSE_CHECKPOINT_DIR", "/run/xpusense/checkpoint")
MAX_REQUEST_BYTES = 64 * 1024   # a request is well under 1 KiB; a larger file is read this far (and fails)

# What signal.signal() returns: a handler, SIG_DFL/SIG_IGN (ints), or None (not set from Python).
_Handler = Callable[[int, FrameType | None], Any] | int | None


class CheckpointRequests:
    """The signal handler only sets a flag, never runs your code:

        requests = CheckpointRequests()            # SIGUSR1 + /run/xpusense/checkpoint
        requests.install()
        for step in range(steps):
            train_step()
            if requests.pending():                 # cheap: a flag check
                req = requests.take()              # the request (dict), or {} for a bare signal
                save_checkpoint()
                requests.done(req, path="ckpt.pt") # optional: tells the agent it was handled

    or `requests.at_safe_point(save_checkpoint)` at the safe point, which calls it when one is pending.

    The agent signals only a process that has a handler for the signal installed (install() does
    it): a process without one gets the request file and event only. The request directory is
    shared by every job on the node (mode 1777, like /tmp): only request files owned by root or by
    the directory's owner (the agent) are read, a symlink there is never followed, and the done file
    is written under a new name of its own before it is renamed into place.
    """

    def __init__(self, directory: str | None = DEFAULT_DIR, signum: int | None = signal.SIGUSR1,
                 poll_s: float = 0.2, pids: set[int] | None = None):
        """directory: where request files appear (None: signals only); signum: None for files only;
        pids: which processes' requests to accept (default: this process and its process group)."""
        self.directory = directory
        self.signum = signum
        self.poll_s = poll_s
        self.pids = pids
        self._flag = threading.Event()
        self._lock = threading.Lock()
        self._queue: list[dict] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler: _Handler = None
        # Signals received, and those accounted for: by a bare-signal request, or by a request file
        # that says a signal comes with it ("signal" in the file). A signal that arrives after its
        # file was already taken (the watcher thread read the file first) is then no new request.
        self._signals = 0
        self._signals_used = 0

    # -- set-up ------------------------------------------------------------------------------
    def install(self) -> CheckpointRequests:
        if self.signum is not None:
            self._previous_handler = signal.signal(self.signum, self._on_signal)
        if self.directory:
            self._seen.update(self._names())  # requests older than this process are not for it
            self._thread = threading.Thread(target=self._watch, name="xpusense-checkpoint", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.poll_s * 5 + 1)
        if self.signum is not None and self._previous_handler is not None:
            signal.signal(self.signum, self._previous_handler)

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.close()

    # -- the training loop's side ------------------------------------------------------------
    def pending(self) -> bool:
        """Cheap while nothing is asked: a flag check. When the flag is set by a signal whose request
        was already taken (its file read first), it is cleared here and nothing is pending."""
        if not self._flag.is_set():
            return False
        if self._signals > self._signals_used:
            return True
        with self._lock:
            self._scan_locked()
            if self._queue:
                return True
        self._flag.clear()
        return self._signals > self._signals_used   # one that landed meanwhile

    def take(self) -> dict:
        """The oldest pending request, {} for a bare signal; the flag stays set while more wait.

        The agent writes the request file before it signals, so a signal and its file are one
        request: the directory is read here, at the safe point, to pair them."""
        self._flag.clear()   # first: a signal that lands during take() sets it again
        with self._lock:
            self._scan_locked()
            if self._queue:
                req = self._queue.pop(0)
                if self._signals > self._signals_used or (req.get("signal") and self.signum is not None):
                    self._signals_used += 1   # its signal: already here, or on its way (the file says so)
            else:
                req = {}
                self._signals_used = min(self._signals, self._signals_used + 1)
            if self._queue:
                self._flag.set()
        return req

    def at_safe_point(self, fn) -> bool:
        """Call fn(request) if a request is pending; returns whether it did."""
        if not self.pending():
            return False
        req = self.take()
        result = fn(req)
        self.done(req, result=str(result) if result is not None else "")
        return True

    def done(self, req: dict, **info) -> None:
        """Record that a request was handled (a `<id>.done.json` beside the request file)."""
        if not req.get("id") or not self.directory:
            return
        rid = os.path.basename(str(req["id"]))
        path = os.path.join(self.directory, f"{rid}.done.json")
        try:
            # A name no one else can have made (O_EXCL|O_NOFOLLOW) in the shared directory.
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{rid}.done-", suffix=".tmp")
        except OSError:
            return  # the agent's directory may be read-only for the job: the checkpoint still happened
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump({"id": req["id"], "pid": os.getpid(), "time": time.time(), **info}, f)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- internals ----------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self._signals += 1   # only a count and a flag: no I/O, no locks, no user code in a signal handler
        self._flag.set()

    def _names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if n.endswith(".json") and not n.endswith(".done.json")
                    and not n.startswith(".")]
        except OSError:
            return []

    def _mine(self, req: dict) -> bool:
        pids = set(req.get("pids") or [])
        if self.pids is not None:
            return bool(pids & self.pids)
        if os.getpid() in pids:
            return True
        try:
            pgid = os.getpgid(0)
            return any(os.getpgid(p) == pgid for p in pids if _alive(p))
        except OSError:
            return False

    def _read_request(self, name: str, owners: set[int]) -> object:
        """The request in `name`, None unless it is a regular file written by root or the agent."""
        assert self.directory
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in owners:
                return None   # another user's file in the shared directory: not a request
            try:
                return json.loads(f.read(MAX_REQUEST_BYTES))
            except (OSError, ValueError):
                return None

    def _scan_locked(self) -> None:
        if not self.directory:
            return
        try:
            owners = {0, os.stat(self.directory).st_uid}
        except OSError:
            return
        for name in sorted(set(self._names()) - self._seen):
            self._seen.add(name)
            req = self._read_request(name, owners)
            if isinstance(req, dict) and self._mine(req):
                self._queue.append(req)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                self._scan_locked()
                if self._queue:
                    self._flag.set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
