"""The agent's grpc wake-up settings take effect in the grpc this agent runs with."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import grpc._common as grpc_common
from grpc._cython import cygrpc

from xpusense.agent.grpc_waits import GRPC_WAKE_S, quiet_completion_queue, quiet_grpc_waits, use_polling_client


def interrupt_period_ms() -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_int.from_address(get(cygrpc.__pyx_capi__["g_interrupt_check_period_ms"], b"int")).value


def test_the_waits_of_grpcs_sync_threads_are_a_second_long_and_never_shortened():
    quiet_grpc_waits()
    assert grpc_common.MAXIMUM_WAIT_TIMEOUT >= GRPC_WAKE_S
    assert interrupt_period_ms() == int(GRPC_WAKE_S * 1000)   # cygrpc's own variable, read back
    assert quiet_completion_queue(0.5) == int(GRPC_WAKE_S * 1000)   # a shorter one leaves it as it is
    assert interrupt_period_ms() == int(GRPC_WAKE_S * 1000)


def _connect_traced(code: str, env: dict[str, str]) -> str:
    """Run `code` then connect a channel to a listening socket in a fresh interpreter, with grpc's tcp
    tracing on: its log names the engine that made the connection."""
    script = code + """
import socket
import grpc
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
ch = grpc.insecure_channel(f"127.0.0.1:{srv.getsockname()[1]}")
try:
    grpc.channel_ready_future(ch).result(timeout=2)
except grpc.FutureTimeoutError:
    pass
ch.close()
"""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}, **env,
           "GRPC_VERBOSITY": "debug", "GRPC_TRACE": "tcp"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60).stderr


def test_the_agent_cli_chooses_grpcs_polling_client_before_grpc_is_imported():
    set_it = "from xpusense.agent import cli\nfrom xpusense.agent.grpc_waits import use_polling_client\n" \
             "import sys\nassert 'grpc' not in sys.modules\nassert use_polling_client() == '-event_engine_client'\n"
    polling = _connect_traced(set_it, {})
    default = _connect_traced("", {})
    assert "tcp_client_posix.cc" in polling    # grpc's polling engine made the connection
    assert "tcp_client_posix.cc" not in default    # the EventEngine client did


def test_an_operators_grpc_experiments_and_a_late_call_are_left_alone():
    env = {"GRPC_EXPERIMENTS": "event_engine_client"}
    assert use_polling_client(env) is None and env == {"GRPC_EXPERIMENTS": "event_engine_client"}
    env = {}
    assert "grpc" in sys.modules   # imported by this test module: too late to take effect
    assert use_polling_client(env) is None and env == {}
