"""Fewer wake-ups of the threads grpc keeps for the agent's one long-lived stream.

grpc's sync API wakes its waiting threads several times a second only so that Python signal handlers
can run; the agent handles signals on its main thread, which never waits on grpc. See each function.
(The other source of wake-ups, grpc's EventEngine client, is turned off by `xpusense-agent run`
before grpc is imported: common/grpc_engine.py.)
"""

from __future__ import annotations

import ctypes
import threading

GRPC_WAKE_S = 1.0    # how often a thread blocked in grpc wakes with nothing to do


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


def wait_connecting(channel, stop: threading.Event, seconds: float) -> None:
    """Wait `seconds` (or until `stop`) with `channel` connecting meanwhile. The agent runs grpc's
    polling engine (common/grpc_engine.py), which sees a connection attempt end only while a thread
    polls the channel: a call in progress, or a connectivity watch. A call fails at once while its
    channel is in backoff, so without a watch a refused or accepted connect was seen only at grpc's
    backup poll, every 5 s: an agent found its collector back 9-19 s after it answered. The watch (a
    thread of grpc's, polling 5 times a second) lasts only this wait."""
    def ignore(_state) -> None:
        return None
    watched = channel if hasattr(channel, "subscribe") else None   # a test's stand-in may not have it
    if watched is not None:
        watched.subscribe(ignore, try_to_connect=True)
    try:
        stop.wait(seconds)
    finally:
        if watched is not None:
            watched.unsubscribe(ignore)
