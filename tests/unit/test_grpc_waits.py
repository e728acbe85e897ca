"""The agent's grpc wake-up settings take effect in the grpc this agent runs with."""

from __future__ import annotations

import ctypes

import grpc._common as grpc_common
from grpc._cython import cygrpc

from xpusense.agent.grpc_waits import GRPC_WAKE_S, quiet_completion_queue, quiet_grpc_waits


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
