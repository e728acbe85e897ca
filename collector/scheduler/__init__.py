"""Scheduler core: ranks the fleet's nodes for a job (a count of devices of a type with enough free
HBM) by the platform's cost-benefit matrix, from the fleet's latest values. The scoring, filters and
modules are described in docs/scheduler.md."""
