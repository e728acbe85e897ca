"""Which of grpc's I/O engines a process runs on: grpc reads GRPC_EXPERIMENTS once, when it is
imported, so each command sets it first thing, before anything imports grpc. A GRPC_EXPERIMENTS the
operator gave (systemd's Environment=, a shell, a pod spec) is theirs and left as it is."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# grpc's EventEngine (its default) hands every read and write to a work-stealing thread pool whose
# idle workers wake on a back-off for nothing; its polling engine (these experiments turned off)
# reads and writes sockets in the threads that already poll the completion queue: fewer wake-ups
# for the agent (agent/grpc_waits.py) and less CPU and fewer context switches a batch for the
# collector (bench/collector_ingest.py, docs/figures.md).
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
POLLING_CLIENT = "-event_engine_client"       # the agent's channels
POLLING_LISTENER = "-event_engine_listener"   # the collector's servers: accepted connections poll too


def choose_engine(experiments: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GRPC_EXPERIMENTS to `experiments` unless the operator set it or grpc is already imported;
    the value set, or None."""
    if EXPERIMENTS_ENV in environ or "grpc" in sys.modules:
        return None
    environ[EXPERIMENTS_ENV] = experiments
    return experiments
