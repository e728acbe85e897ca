"""The pods that the dashboards' names (dcgm-exporter's, npu-exporter's) carry for a device: those the
kubelet assigned it to (the node's latest `xpusense.k8s.device.assigned`), else those with pod
roll-ups on it. A device shared by several pods gives one series per pod, as dcgm-exporter does with
time-slicing and MPS; its utilisation and memory then are each pod's own (docs/export.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from xpusense.common import metric_names as m

from .fleet_interface import FleetSeries

ASSIGNED = m.DEVICE_ASSIGNED
POD, NAMESPACE, CONTAINER = "k8s.pod.name", "k8s.namespace.name", "k8s.container.name"
PodKey = tuple[str, str, str]   # pod, namespace, container

# a device series -> the pod series (and its engine) that holds each pod's own share of it
OWN_SHARE: dict[str, tuple[str, str]] = {
    m.GPU_UTILIZATION: (m.POD_UTILIZATION, "sm"),
    m.MEMORY_CONTROLLER_UTILIZATION: (m.POD_UTILIZATION, "memory"),
    m.GPU_MEMORY_USAGE: (m.POD_MEMORY_USAGE, ""),
}
_ROLLUPS = (m.POD_UTILIZATION, m.POD_MEMORY_USAGE)
_CAP = {m.POD_UTILIZATION: 1.0}


def _pod(labels: Mapping[str, str]) -> PodKey:
    return labels.get(POD, ""), labels.get(NAMESPACE, ""), labels.get(CONTAINER, "")


class DevicePods:
    """One node's pods per device, from its series as they are now. Series older than `cutoff_ns`
    (collector clock, as the scrape leaves them out) are not read."""

    def __init__(self, series: Iterable[FleetSeries], cutoff_ns: int):
        assigned: list[FleetSeries] = []
        rollups: list[FleetSeries] = []
        for ser in series:
            if ser.name == ASSIGNED or ser.name in _ROLLUPS:
                if ser.recv_ns >= cutoff_ns and ser.value == ser.value and POD in ser.labels:
                    (assigned if ser.name == ASSIGNED else rollups).append(ser)
        # The latest refresh's assignments (one refresh shares one stamp; one ended is sent as 0).
        latest = max((s.time_ns for s in assigned), default=0)
        self.from_kubelet = bool(assigned)   # its latest List rules, even when it assigns nothing now
        self.assigned: dict[str, list[PodKey]] = {}
        for s in assigned:
            if s.time_ns == latest and s.value > 0:
                pods = self.assigned.setdefault(s.labels.get("device", ""), [])
                if _pod(s.labels) not in pods:
                    pods.append(_pod(s.labels))
        # The latest round's roll-ups per name: a pod whose processes ended has none in it.
        newest = {name: max((s.time_ns for s in rollups if s.name == name), default=0) for name in _ROLLUPS}
        # (name, device, mig_instance, engine) -> pod -> value
        self.shares: dict[tuple[str, str, str, str], dict[PodKey, float]] = {}
        self.using: dict[tuple[str, str], list[PodKey]] = {}   # (device, mig_instance) -> pods with processes
        for s in rollups:
            if s.time_ns != newest[s.name]:
                continue
            lb = s.labels
            dev, mig, pod = lb.get("device", ""), lb.get("mig_instance", ""), _pod(lb)
            key = (s.name, dev, mig, lb.get("engine", ""))
            self.shares.setdefault(key, {})[pod] = s.value
            for where in ((dev, mig), (dev, "")) if mig else ((dev, ""),):
                pods = self.using.setdefault(where, [])
                if pod not in pods:
                    pods.append(pod)

    def pods(self, device: str, mig: str) -> list[PodKey]:
        """The pods a device's (MIG instance's) series are labelled with: the kubelet's assignment
        when the node has one, else the pods using it; none: the series keeps no pod."""
        if self.from_kubelet:
            return self.assigned.get(device, [])
        return self.using.get((device, mig), [])

    def share(self, name: str, device: str, mig: str, pod: PodKey) -> float | None:
        """On a device several pods share: the pod's own part of device series `name` (0 for a pod
        with no process on it); None where the node has no roll-up for it (then every pod's series
        carries the device's value, as dcgm-exporter's)."""
        spec = OWN_SHARE.get(name)
        if spec is None:
            return None
        rollup, engine = spec
        if mig:
            got = self.shares.get((rollup, device, mig, engine))
            return None if got is None else got.get(pod, 0.0)
        parts = [v for (n, d, _, e), v in self.shares.items() if (n, d, e) == (rollup, device, engine)]
        if not parts:
            return None
        total = sum(p.get(pod, 0.0) for p in parts)
        cap = _CAP.get(rollup)
        return min(total, cap) if cap is not None else total
