"""Each command puts its gRPC on grpc's polling engine before grpc is imported (common/grpc_engine.py):
the agent's channels, the collector's servers; an operator's own choice is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xpusense.common.grpc_engine import POLLING_CLIENT, POLLING_LISTENER, choose_engine

ONE_CONNECTION = """
from concurrent import futures
import grpc
srv = grpc.server(futures.ThreadPoolExecutor(1))
port = srv.add_insecure_port("127.0.0.1:0")
srv.start()
ch = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(ch).result(timeout=30)
ch.close()
srv.stop(0)
"""
# In grpc's tcp trace, the polling engine's files that connected and accepted (the EventEngine's
# are posix_endpoint.cc and the like).
POLLING_CONNECT, POLLING_ACCEPT = "tcp_client_posix.cc", "tcp_server_posix.cc"


def _traced(code: str) -> str:
    """stderr of `code`, then a server and a channel to it connecting once, in a fresh interpreter
    with grpc's tcp tracing on."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GRPC_")},
           "GRPC_VERBOSITY": "debug", "GRPC_TRACE": "tcp"}
    return subprocess.run([sys.executable, "-c", code + ONE_CONNECTION], env=env, capture_output=True,
                          text=True, timeout=120).stderr


@pytest.mark.parametrize("entry, chosen, polls, not_polls", [
    ("xpusense.agent.cli", POLLING_CLIENT, POLLING_CONNECT, POLLING_ACCEPT),
    ("xpusense.collector.main", POLLING_LISTENER, POLLING_ACCEPT, POLLING_CONNECT),
])
def test_a_commands_entry_chooses_the_polling_engine_before_grpc_is_imported(entry, chosen, polls, not_polls):
    out = _traced(f"import sys\nimport {entry}\nassert 'grpc' not in sys.modules, 'the entry imports grpc'\n"
                  f"from xpusense.common.grpc_engine import choose_engine\nassert choose_engine({chosen!r})\n")
    assert polls in out and not_polls not in out
    default = _traced("")
    assert POLLING_CONNECT not in default and POLLING_ACCEPT not in default


def test_python_m_cluster_runs_on_the_collectors_engine():
    """`python -m xpusense.collector.cluster` (how the bench starts gateways and scheduler replicas)
    chooses the engine `xpusense-collector` does. Before, it ran on grpc's default, and
    bench/fleet_scale.py measured that instead of what is deployed."""
    out = _traced("import runpy, sys\nsys.argv = ['cluster', '--help']\ntry:\n"
                  "    runpy.run_module('xpusense.collector.cluster', run_name='__main__')\n"
                  "except SystemExit:\n    pass\n")
    assert POLLING_ACCEPT in out and POLLING_CONNECT not in out


def test_an_operators_choice_and_a_late_call_are_left_alone():
    env = {"GRPC_EXPERIMENTS": "event_engine_listener"}
    assert choose_engine(POLLING_LISTENER, env) is None and env == {"GRPC_EXPERIMENTS": "event_engine_listener"}
    env = {}
    import grpc  # noqa: F401  (imported: too late to take effect)
    assert choose_engine(POLLING_CLIENT, env) is None and env == {}
