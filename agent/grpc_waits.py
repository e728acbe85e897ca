"""Fewer wake-ups of the threads grpc keeps for the agent's one long-lived stream.

grpc's sync API wakes its waiting threads several times a second only so that Python signal handlers
can run; the agent handles signals on its main thread, which never waits on grpc. grpc's EventEngine
client wakes its idle workers 24-28 times a second for a stream that sends one message a second. See
each function.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import MutableMapping

GRPC_WAKE_S = 1.0    # how often a thread blocked in grpc wakes with nothing to do
# grpc's setting of its experiments (read once, when grpc is imported), and the agent's value of it.
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
POLLING_CLIENT = "-event_engine_client"


def use_polling_client(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Before grpc is imported (`xpusense-agent run` calls it first): the agent's channels run on
    grpc's polling engine (the experiment event_engine_client off), not on its EventEngine client.
    The EventEngine client hands every read and write to a work-stealing thread pool whose idle
    workers wake with a back-off that starts again at 15 ms each time they run a closure (x1.3 up to
    3 s): with a message and its ack every second, each of two workers wakes ~12 times a second, 24-28
    wake-ups of the agent a second (~0.1 ms of CPU each on a small VM) for nothing. The polling
    engine reads the socket in the thread that already waits on the channel's completion queue.
    Only an environment variable sets it, read when grpc is imported: a GRPC_EXPERIMENTS given to
    the agent (systemd's Environment=, a shell) is the operator's choice and left as it is; so is
    everything once grpc is imported (too late to take effect). The value set, or None."""
    if EXPERIMENTS_ENV in environ or "grpc" in sys.modules:
        return None
    environ[EXPERIMENTS_ENV] = POLLING_CLIENT
    return POLLING_CLIENT


def quiet_grpc_waits(every_s: float = GRPC_WAKE_S) -> None:
    """grpc's synchronous API wakes each thread blocked on a call every 100 ms
    (grpc._common.MAXIMUM_WAIT_TIMEOUT) only so that a signal handler can run on the main thread; the
    agent's calls wait in threads of their own and its signals are handled on the main thread, so
    those wake-ups buy nothing and cost the stream's sender thread nearly all of its CPU, a tenth of
    the agent's (per-thread CPU under bench/footprint.py). Deadlines and completions do not depend
    on it: the waits are on conditions that grpc notifies. Left alone when a grpc release no longer
    has the setting."""
    import grpc._common as grpc_common
    if isinstance(getattr(grpc_common, "MAXIMUM_WAIT_TIMEOUT", None), float):
        grpc_common.MAXIMUM_WAIT_TIMEOUT = max(grpc_common.MAXIMUM_WAIT_TIMEOUT, every_s)
    quiet_completion_queue(every_s)


def quiet_completion_queue(every_s: float = GRPC_WAKE_S) -> int | None:
    """The same for the thread that polls a channel's completion queue for the sync API's calls
    (cygrpc's `_next` returns to Python every g_interrupt_check_period_ms, 200, only to check for
    signals): it then wakes once a second, not five times. The setting is a C int that cygrpc
    exports (as gevent support sets it to 2000); the value now set, or None where a grpc release
    does not export it."""
    try:
        from grpc._cython import cygrpc
        cap = cygrpc.__pyx_capi__["g_interrupt_check_period_ms"]
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        addr = get(cap, b"int")
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return None
    if not addr:
        return None
    period = ctypes.c_int.from_address(addr)
    period.value = max(period.value, int(every_s * 1000))
    return period.value
