"""Starting the eBPF loader process (loader_main.py) and receiving what it hands over, with a deadline;
a loader that exits, is killed or does not answer becomes Unavailable with a reason to act on.
`xpusense-agent run` imports this before its own imports and starts the loader then (start_early),
so this module imports little: no logging, tempfile, base's dataclasses or map code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import IO

from . import fd_channel
from .caps import bpf_capable

# How the loader process starts: the agent's own interpreter, every import path the agent has that a
# fresh interpreter lacks (a site directory added at run time, with its .pth files: an editable
# install's finder), then the loader on the inherited socket: loader_main.main, which, when the agent's
# config file is named, compiles the request the agent will send before it comes.
LOADER_BOOT = ("import json, site, sys\n"
               "for p in json.loads(sys.argv[1]):\n"
               "    if p not in sys.path: site.addsitedir(p)\n"
               "from xpusense.agent.sources.ebpf.loader_main import main\n"
               "main(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)\n")


def loader_argv(fd: int, config_path: str | None = None) -> list[str]:
    """The loader process's command line, on socket `fd`; `config_path`: compile ahead from that config
    ("" for the built-in defaults; None: wait for the request)."""
    return [sys.executable, "-c", LOADER_BOOT, json.dumps(sys.path), str(fd),
            *(() if config_path is None else (config_path,))]


class LoaderProcess:
    """The loader process, started before the request is ready (it imports bcc and pyroute2 while the
    agent plans the probes); `ask` sends the request and waits for the hand-over. Raises Unavailable
    with the reason when it cannot start, exits, is killed or does not answer within the deadline
    (then it is killed); `close` makes an unused one go away (EOF on its socket)."""

    def __init__(self, argv: Callable[[int], list[str]]):
        self._sock, theirs = fd_channel.pair()
        self._err = open(os.memfd_create("xpusense-loader-stderr", os.MFD_CLOEXEC), "w+b")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv(theirs.fileno()), pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, stdout=self._err, stderr=self._err)
        except OSError as e:
            self.close()
            raise unavailable(f"cannot start the eBPF loader process ({e})") from e
        finally:
            theirs.close()

    def send(self, request: dict) -> None:
        """The request; a failure to send shows in receive() (the process is gone)."""
        try:
            fd_channel.send(self._sock, request)
        except OSError:
            pass

    def receive(self, timeout_s: float, deadline_said_s: float | None = None) -> tuple[dict, list[int]]:
        """The manifest and its fds; `deadline_said_s`: the deadline to name when it runs out."""
        proc = self.proc
        try:
            return fd_channel.recv(self._sock, timeout_s)
        except (fd_channel.ChannelError, OSError) as e:
            timed_out = "timed out" in str(e)
            if timed_out:
                proc.kill()
            self._reap()
            said = timeout_s if deadline_said_s is None else deadline_said_s
            raise unavailable(loader_failure(proc.pid, proc.returncode, timed_out, said, _tail(self._err))) from None
        finally:
            self.close()

    def ask(self, request: dict, timeout_s: float) -> tuple[dict, list[int]]:
        self.send(request)
        return self.receive(timeout_s)

    def _reap(self) -> None:
        try:
            self.proc.wait(10)      # it exits as soon as the fds are sent, or on EOF
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._sock.close()
        if getattr(self, "proc", None) is not None:
            self._reap()
        self._err.close()


def unavailable(reason: str) -> Exception:
    """base.Unavailable, imported only when one is raised (base's imports would slow the early start)."""
    from ..base import Unavailable
    return Unavailable(reason)


def run_loader(argv: Callable[[int], list[str]], request: dict, timeout_s: float) -> tuple[dict, list[int]]:
    """Start the loader process, send `request`, return its manifest and fds (see LoaderProcess)."""
    return LoaderProcess(argv).ask(request, timeout_s)


def loader_failure(pid: int, returncode: int | None, timed_out: bool, timeout_s: float, stderr_tail: str) -> str:
    """The Unavailable reason when the loader process handed nothing over."""
    said = f"; it said: {stderr_tail}" if stderr_tail else ""
    if timed_out:
        return (f"the eBPF loader process (pid {pid}) handed nothing over within {timeout_s:.0f} s and was killed "
                f"(compiling stuck or the machine overloaded?){said}; the other sources run, restart the agent to "
                f"try again")
    if returncode is not None and returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exited with status {returncode}"
    return (f"the eBPF loader process (pid {pid}) {how} before handing over the probes{said}; the other "
            f"sources run, restart the agent to try again")


def _tail(f: IO[bytes], n: int = 400) -> str:
    try:
        f.seek(0)
        text = f.read().decode(errors="replace").strip()
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-n:]


# The loader process `xpusense-agent run` starts first thing, before its own imports (start_early), so
# that the loader compiles the probes (from the agent's config file) while the agent starts; the
# agent's EbpfLoader takes it instead of starting one (take_early), and the CLI lets go of one nobody
# took (discard_early: eBPF off in the config).
_early: LoaderProcess | None = None


def wants_ebpf(config_path: str) -> bool:
    """Whether the config file at `config_path` ("": the built-in defaults) leaves eBPF probes on. A file
    that cannot be read says no here: the agent's own loading of it gives the reason."""
    if not config_path:
        return True
    import tomllib
    try:
        with open(config_path, "rb") as f:
            table = tomllib.load(f).get("sources", {}).get("ebpf", {})
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(table, dict) and table.get("enabled", True) is not False and table.get("probes", True) != []


def start_early(config_path: str) -> None:
    """Start the loader process now, compiling ahead from `config_path` ("": the built-in defaults),
    where this process may load eBPF programs and the config leaves the probes on."""
    global _early
    if _early is None and bpf_capable() and wants_ebpf(config_path):
        try:
            _early = LoaderProcess(lambda fd: loader_argv(fd, config_path))
        except Exception as e:      # unavailable(): no early start; EbpfLoader starts one and says why
            import logging
            logging.getLogger("xpusense.agent.sources.ebpf").debug("no early eBPF loader: %s", e)


def take_early() -> LoaderProcess | None:
    """The loader process start_early started, now the caller's (None when there is none)."""
    global _early
    proc, _early = _early, None
    return proc


def discard_early() -> None:
    """End an early loader process nobody took (EOF on its socket: it exits)."""
    proc = take_early()
    if proc is not None:
        proc.close()
