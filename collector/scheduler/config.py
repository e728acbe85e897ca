"""The scheduler's configuration: the [scheduler] schema, the weights of the cost-benefit matrix and
their ranges, the checks the per-key validators cannot make, and the settings the core runs with.

The collector's schema (collector/config.py) embeds SCHEDULER_SCHEMA and calls check_config after
loading; the core is handed the loaded [scheduler] section and `stale_s` (Settings.from_section),
so nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from xpusense.common.config import ConfigError, Key, Table, non_negative, positive, ratio
from xpusense.v1 import scheduler_pb2 as spb

from .scoring import RegionMatrix, region_matrix

DIMENSIONS = ("compute", "data_affinity", "disaster_tolerance", "compliance")
WEIGHT_RANGES = {
    "compute": (0.30, 0.50),
    "data_affinity": (0.20, 0.30),
    "disaster_tolerance": (0.15, 0.25),
    "compliance": (0.05, 0.15),
}
DEFAULT_WEIGHTS = {"compute": 0.40, "data_affinity": 0.25, "disaster_tolerance": 0.20, "compliance": 0.15}


def weight_check(name: str) -> Callable[[Any], str | None]:
    """The range check of one weight: None when in range, else the complaint (with a hint when the
    value looks like a percentage)."""
    lo, hi = WEIGHT_RANGES[name]

    def check(v: Any) -> str | None:
        if lo - 1e-9 <= v <= hi + 1e-9:
            return None
        hint = f" (a ratio: {v / 100:g} for {v:g}%)" if v > 1 else ""
        return f"must be between {lo:g} and {hi:g} ({lo * 100:.0f}-{hi * 100:.0f}%){hint}"
    return check


SCHEDULER_SCHEMA = {
    "weights": {k: Key((int, float), DEFAULT_WEIGHTS[k], weight_check(k),
                       help=f"{k} weight, {WEIGHT_RANGES[k][0]:g}-{WEIGHT_RANGES[k][1]:g}; the four add up to 1")
                for k in DIMENSIONS},
    "xid_window_s": Key((int, float), 600.0, non_negative,
                        help="an accelerator with an XID or double-bit ECC event this recent is not offered"),
    "hbm_watch_window_s": Key((int, float), 300.0, non_negative,
                              help="an accelerator whose HBM watch asked for a checkpoint this recently is penalised"),
    "hbm_watch_factor": Key((int, float), 0.5, ratio,
                            help="score factor of a node whose chosen devices include such an accelerator"),
    "index_refresh_ms": Key((int, float), 1000.0, non_negative,
                            help="a stored batch reaches the index within this (refreshed in bulk off the ingest "
                                 "path, and before each decision); 0: on every batch"),
    "region_latency_ms": Key(Table, Table(), help='"node-region/data-region" = round-trip ms (symmetric unless '
                                                  'both given); a recent measurement of the pair takes its place'),
    "measured_latency_window_s": Key((int, float), 180.0, positive,
                                     help="a node's measured RTT to a region (xpusense.network.tcp.rtt) is the median "
                                          "of its samples over this long"),
    "measured_latency_max_age_s": Key((int, float), 300.0, non_negative,
                                      help="a node's measured RTT counts this long after its last new sample; then "
                                           "the configured latency is used again (0: never measured)"),
    "region_transfer_cost": Key(Table, Table(), help='"node-region/data-region" = price per GB moved'),
    "latency_ref_ms": Key((int, float), 100.0, positive, help="latency at which the latency half of data affinity is 0"),
    "transfer_cost_ref": Key((int, float), 0.10, positive, help="price per GB at which the cost half of data affinity is 0"),
    "peak_tflops": Key(Table, Table(), help="model = dense FP16 TFLOPS, for models the catalogs lack"),
}


def check_config(cfg: Any, where: str) -> None:
    """What the per-key checks cannot see: the weights' sum and the tables' numbers."""
    section = cfg.scheduler
    weights = vars(section.weights)
    total = sum(weights.values())
    if abs(total - 1.0) > 1e-6:
        parts = ", ".join(f"{k}={weights[k]:g}" for k in DIMENSIONS)
        raise ConfigError(f"{where}: 'scheduler.weights' add up to {total:g}, not 1 ({parts}); "
                          f"change them so that they total 1 (100%)")
    for table in ("region_latency_ms", "region_transfer_cost", "peak_tflops"):
        for k, v in getattr(section, table).items():
            _check_table_entry(where, table, k, v)


def _check_table_entry(where: str, table: str, name: str, text: str) -> None:
    key = f"scheduler.{table}.{name!r}"
    try:
        x = float(text)
    except ValueError:
        raise ConfigError(f"{where}: '{key}' must be a number, got {text!r}") from None
    if not x >= 0 or (table == "peak_tflops" and x == 0):
        raise ConfigError(f"{where}: '{key}' must be {'greater than 0' if table == 'peak_tflops' else '0 or more'}, "
                          f"got {text!r}")
    if table != "peak_tflops" and (name.count("/") != 1 or not all(name.split("/"))):
        raise ConfigError(f"{where}: '{key}' must be named \"node-region/data-region\"")


class PlaceError(ValueError):
    """A request the core cannot answer as asked (bad weights, missing data region...)."""


def resolve_weights(base: dict[str, float], override: spb.Weights | dict | None = None) -> dict[str, float]:
    """The configured weights with a request's overrides; each in its range and all adding up to 1."""
    weights = dict(base)
    if isinstance(override, spb.Weights):
        override = {k: getattr(override, k) for k in DIMENSIONS if override.HasField(k)}
    for k, v in (override or {}).items():
        if k not in WEIGHT_RANGES:
            raise PlaceError(f"unknown weight {k!r} (known: {', '.join(DIMENSIONS)})")
        weights[k] = float(v)
    for k in DIMENSIONS:
        why = weight_check(k)(weights[k])
        if why:
            raise PlaceError(f"weight '{k}' {why}, got {weights[k]:g}")
    total = sum(weights.values())
    if abs(total - 1.0) > 1e-6:
        parts = ", ".join(f"{k}={weights[k]:g}" for k in DIMENSIONS)
        raise PlaceError(f"weights add up to {total:g}, not 1 ({parts}); give weights that total 1 (100%)")
    return weights


class Settings(NamedTuple):
    """What the core runs with, from the loaded [scheduler] section and the collector's stale_s."""
    weights: dict[str, float]
    stale_ns: int
    xid_window_ns: int
    hbm_watch_window_ns: int
    hbm_watch_factor: float
    regions: RegionMatrix
    peak_tflops: dict[str, float]   # model -> TFLOPS, from [scheduler.peak_tflops]
    latency_window_ns: int = 180_000_000_000    # [scheduler] measured_latency_window_s
    latency_max_age_ns: int = 300_000_000_000   # [scheduler] measured_latency_max_age_s

    @classmethod
    def from_section(cls, section: Any, stale_s: float) -> Settings:
        """`section`: the loaded (and checked) [scheduler] table, as load_collector returns it."""
        return cls(weights=resolve_weights(vars(section.weights)),
                   stale_ns=int(stale_s * 1e9),
                   xid_window_ns=int(section.xid_window_s * 1e9),
                   hbm_watch_window_ns=int(section.hbm_watch_window_s * 1e9),
                   hbm_watch_factor=float(section.hbm_watch_factor),
                   regions=region_matrix(section.region_latency_ms, section.region_transfer_cost,
                                         float(section.latency_ref_ms), float(section.transfer_cost_ref)),
                   peak_tflops={k: float(v) for k, v in section.peak_tflops.items()},
                   latency_window_ns=int(section.measured_latency_window_s * 1e9),
                   latency_max_age_ns=int(section.measured_latency_max_age_s * 1e9))
