"""Which of grpc's I/O engines a process runs on: grpc reads GRPC_EXPERIMENTS once, when it is
imported, so each command sets it first thing, before anything imports grpc.

grpc 1.85 runs clients and servers on its EventEngine by default, where every read and write of a
connection is a closure handed to a work-stealing thread pool. Its polling engine (the experiments
below turned off) reads and writes sockets in the threads that already poll the completion queue.
Measured on a 2-core VM:
- agent (one stream, a message and its ack a second): the pool's idle workers wake with a back-off
  that starts again at 15 ms after every closure, 24-28 wake-ups a second for nothing; the polling
  client wakes 5-6 times (bench/footprint.py, agent/grpc_waits.py);
- collector (2,000 agents, a batch a second each): 685 -> 515 us of CPU a batch, 1,459 -> 1,926
  batches/s stored on one core, context switches a batch 7.6 -> 1.5 (bench/collector_ingest.py).

A GRPC_EXPERIMENTS the operator gave (systemd's Environment=, a shell, a pod spec) is theirs and left
as it is, as is everything once grpc is imported (too late to take effect).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

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
