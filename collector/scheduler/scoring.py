"""The four dimensions of the platform's cost-benefit matrix, as pure functions of numbers and labels:

    total = (w_compute * compute + w_data * data_affinity + w_dr * disaster_tolerance
             + w_compliance * compliance) * product(penalty factors)

Each dimension is a number from 0 (worst) to 1 (best). The index (index.py) precomputes the compute
dimension per device count; the search (search.py) works the other three out once per placement key;
explain.py says in words how each was reached.
"""

from __future__ import annotations

from typing import NamedTuple

UNKNOWN_VALUE_NORM = 0.5    # value_norm of a device whose TFLOPS or price is unknown
NO_READINGS_FREE = 0.5      # free score of a device with no utilisation/HBM readings yet

# -- compute efficiency --------------------------------------------------------------------------


def free_score(util: float, used: float, free: float, total: float, bandwidth: float) -> float:
    """How free one accelerator is, 0..1: the mean of (1 - utilisation), (free HBM / HBM) and
    (1 - HBM bandwidth utilisation), over the readings the device has. A reading is missing when
    it is NaN (or negative); the HBM share counts when `used` was read and `total` is known.
    Utilisations above 1 count as 1. NO_READINGS_FREE when the device has none of the three."""
    acc, k = 0.0, 0
    if util >= 0:
        acc += 1.0 - (util if util < 1.0 else 1.0)
        k += 1
    if used >= 0 and total > 0:
        acc += free / total
        k += 1
    if bandwidth >= 0:
        acc += 1.0 - (bandwidth if bandwidth < 1.0 else 1.0)
        k += 1
    return acc / k if k else NO_READINGS_FREE


def value_per_price(tflops: float | None, price: float | None) -> float:
    """Peak TFLOPS per price per accelerator-hour; -1 when the TFLOPS or the price is unknown."""
    return tflops / price if tflops and price else -1.0


def value_norm(value: float, inv_best_value: float) -> float:
    """A value per price relative to the fleet's best (`inv_best_value` = 1 / best value), 0..1;
    UNKNOWN_VALUE_NORM when the value is unknown (negative)."""
    return value * inv_best_value if value >= 0 else UNKNOWN_VALUE_NORM


def compute_efficiency(norm: float, mean_free: float) -> float:
    """The compute dimension: value_norm x the mean free score of the chosen devices."""
    return norm * mean_free


# -- data affinity ---------------------------------------------------------------------------------


class RegionMatrix(NamedTuple):
    """From config: (node region, data region) -> latency in ms and transfer price per GB, and the
    figures at which each half of data affinity reaches 0."""
    latency_ms: dict[tuple[str, str], float]
    transfer_cost: dict[tuple[str, str], float]
    latency_ref_ms: float
    transfer_cost_ref: float


def region_pairs(table: dict[str, str]) -> dict[tuple[str, str], float]:
    """{"a/b": "5"} -> {(a, b): 5.0, (b, a): 5.0}: symmetric, unless both directions are given."""
    out: dict[tuple[str, str], float] = {}
    for k, v in table.items():
        a, b = k.split("/")
        out[(a, b)] = float(v)
    for (a, b), figure in list(out.items()):
        out.setdefault((b, a), figure)
    return out


def region_matrix(latency_ms: dict[str, str], transfer_cost: dict[str, str], latency_ref_ms: float,
                  transfer_cost_ref: float) -> RegionMatrix:
    """The RegionMatrix of the config's [scheduler.region_latency_ms] and [...region_transfer_cost]."""
    return RegionMatrix(region_pairs(latency_ms), region_pairs(transfer_cost), latency_ref_ms, transfer_cost_ref)


def data_affinity(node_region: str, data_region: str, regions: RegionMatrix,
                  measured_ms: float | None = None) -> float:
    """1 - 0.5 * min(1, latency / latency_ref) - 0.5 * min(1, transfer cost / transfer_cost_ref),
    node region -> data region, a half counting in full (1) when its figure is unknown. The latency
    is `measured_ms` (the pair's measured round-trip time, latency.py) when given, else the
    matrix's. 1 when no data region is given or the node is in it; 0 when the node has no region
    or neither figure is known for the pair."""
    if not data_region:
        return 1.0
    if not node_region:
        return 0.0
    if node_region == data_region:
        return 1.0
    lat = measured_ms if measured_ms is not None else regions.latency_ms.get((node_region, data_region))
    cost = regions.transfer_cost.get((node_region, data_region))
    if lat is None and cost is None:
        return 0.0
    lat_part = 1.0 if lat is None else min(1.0, lat / regions.latency_ref_ms)
    cost_part = 1.0 if cost is None else min(1.0, cost / regions.transfer_cost_ref)
    return 1.0 - 0.5 * lat_part - 0.5 * cost_part


# -- disaster tolerance ----------------------------------------------------------------------------


def disaster_tolerance(zone: str, replica_zones: list[str]) -> float:
    """1 - (the job's other replicas in the node's zone) / (all other replicas): 1 when no other
    replicas are given, 0.5 when the node has no zone label."""
    if not replica_zones:
        return 1.0
    if not zone:
        return 0.5
    return 1.0 - replicas_in_zone(zone, replica_zones) / len(replica_zones)


def replicas_in_zone(zone: str, replica_zones: list[str]) -> int:
    return sum(1 for z in replica_zones if z == zone)


# -- compliance ------------------------------------------------------------------------------------

_NOT_CAPABLE = {"", "0", "false", "no", "none", "off", "n/a", "unsupported"}


def capable(label: str | None) -> bool:
    """Whether an `encryption` / `attestation` node label names a capability: a capability name or
    true does; absent, empty, none, false, no, off, 0, n/a and unsupported do not."""
    return (label or "").strip().lower() not in _NOT_CAPABLE


def compliance(encryption: bool, attestation: bool) -> float:
    """0.5 for an encryption capability + 0.5 for an attestation capability."""
    return 0.5 * encryption + 0.5 * attestation
