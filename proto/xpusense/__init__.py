"""xpusense: node telemetry for GPU and NPU fleets (agent, collector, wire contract)."""

__version__ = "0.1.0"
