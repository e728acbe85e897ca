"""Per-pod roll-ups: each pod container's use of each accelerator, summed from its processes' series
once agent/pods.py has labelled them with their pod. Works on names alone, so NVML's and npu-smi's
process series roll up alike; a round's samples give that round's roll-ups (docs/metrics.md,
"Kubernetes")."""

from __future__ import annotations

from xpusense.common import metric_names as m

from .pods import CONTAINER, NAMESPACE, POD_NAME
from .sources.base import GAUGE, Sample

# process series -> (pod series, the labels kept besides the pod's, cap on the sum or None)
ROLLUPS: dict[str, tuple[str, tuple[str, ...], float | None]] = {
    m.PROCESS_UTILIZATION: (m.POD_UTILIZATION, ("device", "vendor", "mig_instance", "engine"), 1.0),
    m.PROCESS_MEMORY_USAGE: (m.POD_MEMORY_USAGE, ("device", "vendor", "mig_instance"), None),
}
POD_LABELS = (POD_NAME, NAMESPACE, CONTAINER)


def pod_rollups(samples: list[Sample]) -> list[Sample]:
    """The pod series of the process series among `samples` that name their pod: one per pod
    container, device (MIG instance) and engine, the sum of its processes' values (utilisation
    capped at 1), stamped with the latest of its processes' times. Processes of no known pod are
    left out."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], list] = {}
    for s in samples:
        spec = ROLLUPS.get(s.name)
        if spec is None or POD_NAME not in s.labels or s.value != s.value:   # NaN: no reading
            continue
        name, keep, _ = spec
        lb = s.labels
        key = (name, tuple((k, lb[k]) for k in (*keep, *POD_LABELS) if k in lb))
        got = sums.get(key)
        if got is None:
            sums[key] = [s.value, s.unit, s.time_ns]
        else:
            got[0] += s.value
            got[2] = max(got[2], s.time_ns)
    out = []
    for (name, labels), (value, unit, t) in sums.items():
        cap = next(c for n, _, c in ROLLUPS.values() if n == name)
        out.append(Sample(name, min(value, cap) if cap is not None else value, unit, dict(labels), GAUGE, t))
    return out
