"""Pod attribution: which Kubernetes pod and container a process or a cgroup belongs to, from the
cgroup path (/proc/PID/cgroup), the container runtime's metadata, and the kubelet's pod-resources
API (which devices the kubelet assigned to which container). Samples that carry `pid` or `cgroup`
get k8s.pod.uid and container.id (the cgroup path alone), and k8s.pod.name, k8s.namespace.name,
k8s.container.name (the runtime's metadata, or the pod-resources assignment of their `device`);
the assignments also become samples (`xpusense.k8s.device.assigned`). docs/export.md has the detail."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable

import grpc

from xpusense.common.metric_names import DEVICE_ASSIGNED
from xpusense.common.supervise import TASKS
from xpusense.podresources.v1 import api_pb2, api_pb2_grpc

from .sources.base import GAUGE, Event, Sample

log = logging.getLogger("xpusense.agent.pods")

POD_NAME, NAMESPACE, CONTAINER = "k8s.pod.name", "k8s.namespace.name", "k8s.container.name"
POD_UID, CONTAINER_ID = "k8s.pod.uid", "container.id"

_UID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
_SYSTEMD_POD = re.compile(rf"kubepods(?:-(?:besteffort|burstable|guaranteed))?-pod({_UID})\.slice")
_CGROUPFS_POD = re.compile(rf"kubepods(?:/(?:besteffort|burstable|guaranteed))?/pod({_UID})(?:/|$)")
# crio-conmon-<id>.scope is CRI-O's monitor process, not the container: not matched.
_SYSTEMD_CTR = re.compile(r"(?:cri-containerd|crio|docker|containerd)-([0-9a-f]{64})\.scope")
_CGROUPFS_CTR = re.compile(r"pod" + _UID + r"/([0-9a-f]{64})(?:/|$)")

DEFAULT_METADATA_DIRS = ["/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                         "/run/containers/storage/overlay-containers", "/var/lib/docker/containers"]


def parse_cgroup_path(path: str) -> dict[str, str]:
    """A cgroup path -> {k8s.pod.uid, container.id} (what it names; {} for a non-pod cgroup), as the
    two kubelet cgroup drivers and the runtimes write them (v1 and v2 alike):
    - systemd: /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, '-' as '_'>.slice/
      cri-containerd-<id>.scope | crio-<id>.scope | docker-<id>.scope (guaranteed: kubepods-pod<uid>.slice)
    - cgroupfs: /kubepods/burstable/pod<uid>/<id> (guaranteed: /kubepods/pod<uid>/<id>)
    In a private cgroup namespace the path is relative (`/../../kubepods...`): the patterns are searched."""
    out: dict[str, str] = {}
    m = _SYSTEMD_POD.search(path) or _CGROUPFS_POD.search(path)
    if not m:
        return out
    out[POD_UID] = m.group(1).replace("_", "-").lower()
    c = _SYSTEMD_CTR.search(path) or _CGROUPFS_CTR.search(path)
    if c:
        out[CONTAINER_ID] = c.group(1)
    return out


def parse_proc_cgroup(text: str) -> str:
    """/proc/PID/cgroup text -> the cgroup path that places the process (the v2 entry; on v1 the first
    hierarchy whose path names a pod, else the first one)."""
    v1 = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            return path
        v1.append(path)
    for p in v1:
        if "kubepods" in p:
            return p
    return v1[0] if v1 else ""


def parse_runtime_metadata(doc: dict) -> dict[str, str]:
    """An OCI config.json (containerd, CRI-O) or Docker config.v2.json -> pod/namespace/container."""
    ann = doc.get("annotations") or {}
    labels = (doc.get("Config") or {}).get("Labels") or {}
    src = {**labels, **ann}
    pick = {
        POD_NAME: ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
        NAMESPACE: ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
        CONTAINER: ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
        POD_UID: ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"),
    }
    out = {}
    for key, names in pick.items():
        for n in names:
            if src.get(n):
                out[key] = str(src[n])
                break
    if out.get(CONTAINER) == "POD":   # Docker's name for the pause container
        out.pop(CONTAINER)
    return out


def read_runtime_metadata(dirs: Iterable[str], container_id: str) -> dict[str, str]:
    """The container's name, its pod's name and namespace, found by container id under each of `dirs`:
    containerd's bundle `<dir>/<id>/config.json` (annotations io.kubernetes.cri.*), CRI-O's
    `<dir>/<id>/userdata/config.json` (io.kubernetes.*), Docker's `<dir>/<id>/config.v2.json`
    (Config.Labels io.kubernetes.*)."""
    for d in dirs:
        for rel in ("config.json", "userdata/config.json", "config.v2.json"):
            path = os.path.join(d, container_id, rel)
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            got = parse_runtime_metadata(doc) if isinstance(doc, dict) else {}
            if got:
                return got
    return {}


# -------------------------------------------------------------------------------- pod-resources

class Assignment:
    __slots__ = ("namespace", "pod", "container", "resource", "device_ids")

    def __init__(self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]):
        self.namespace, self.pod, self.container = namespace, pod, container
        self.resource, self.device_ids = resource, device_ids


def list_pod_resources(socket_path: str, timeout_s: float = 2.0) -> list[Assignment]:
    """The kubelet's pod-resources List: every (pod, container, resource, device ids) assigned."""
    with grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}") as ch:
        reply = api_pb2_grpc.PodResourcesListerStub(ch).List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    out = []
    for p in reply.pod_resources:
        for c in p.containers:
            for d in c.devices:
                if d.device_ids:
                    out.append(Assignment(p.namespace, p.name, c.name, d.resource_name, list(d.device_ids)))
    return out


_ASCEND_PLUGIN_ID = re.compile(r"Ascend[0-9A-Za-z]*-(\d+)")


def device_plugin_ids(resources: Iterable[dict]) -> dict[str, str]:
    """Our inventory resources -> {device plugin's id: our device id}.

    NVIDIA's device plugin names GPUs by UUID (MIG instances by MIG UUID); Ascend's names chips
    `Ascend910-<physical id>` (`Ascend310P-<n>`...): we know the physical id where npu-smi gave it,
    else the NPU ID for one chip per card."""
    out: dict[str, str] = {}
    for r in resources:
        rid = str(r.get("id", ""))
        attrs = r.get("attributes", {}) or {}
        if not rid:
            continue
        out[rid] = rid
        if attrs.get("uuid"):
            out[str(attrs["uuid"])] = rid
        if r.get("type") == "NPU":
            phy = attrs.get("phy_id")
            m = re.fullmatch(r"npu(\d+)-(\d+)", rid)
            if not phy and m and str(attrs.get("chips_per_card", "1")) == "1":
                phy = m.group(1)
            if phy:
                out[f"ascend:{phy}"] = rid
    return out


def our_device(plugin_id: str, ids: dict[str, str]) -> str:
    """Our device id for a device plugin's; NVIDIA's time-slicing replicas `<uuid>::<n>` are the GPU's."""
    if plugin_id in ids:
        return ids[plugin_id]
    base, sep, _ = plugin_id.partition("::")
    if sep and base in ids:
        return ids[base]
    m = _ASCEND_PLUGIN_ID.fullmatch(plugin_id)
    if m:
        return ids.get(f"ascend:{m.group(1)}", "")
    return ""


# -------------------------------------------------------------------------------- the labeller

class PodLabeler:
    def __init__(self, procfs: str = "/proc", pod_resources_socket: str = "",
                 metadata_dirs: Iterable[str] = DEFAULT_METADATA_DIRS, refresh_s: float = 10.0,
                 resources: Callable[[], list[dict]] | None = None, timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.procfs = procfs
        self.socket = pod_resources_socket
        self.metadata_dirs = list(metadata_dirs)
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.resources = resources or (lambda: [])
        self.clock = clock
        self._lock = threading.Lock()
        self._pids: dict[str, tuple[float, dict]] = {}
        self._cgroups: dict[str, tuple[float, dict]] = {}
        self._meta: dict[str, tuple[float, dict]] = {}
        self._by_device: dict[str, dict] = {}        # our device id -> names of the one container it is assigned to
        self._assigned: list[tuple[str, Assignment, str]] = []
        self._assigned_new = False
        self._sent: set[tuple] = set()               # the assignments last sent, as label items
        self.last_error = ""
        self.refreshes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- pod-resources
    def refresh(self) -> None:
        """Read the kubelet's assignments once (a missing socket: none, said once in the log)."""
        if not self.socket:
            return
        if not os.path.exists(self.socket):
            if self.last_error != "missing":
                log.info("pod-resources socket %s not found: pods are named from the runtime's metadata only "
                         "(mount /var/lib/kubelet/pod-resources into the agent's pod)", self.socket)
            self.last_error = "missing"
            return
        try:
            got = list_pod_resources(self.socket, self.timeout_s)
        except Exception as e:
            details_fn = getattr(e, "details", None)   # grpc.RpcError has details()
            details = details_fn() if callable(details_fn) else e
            msg = f"pod-resources List on {self.socket} failed: {details}"
            if msg != self.last_error:
                log.warning("%s; device assignments are not known until it works", msg)
            self.last_error = msg
            return
        ids = device_plugin_ids(self.resources())
        by_device: dict[str, dict] = {}
        assigned = []
        for a in got:
            names = {POD_NAME: a.pod, NAMESPACE: a.namespace, CONTAINER: a.container}
            for pid_ in a.device_ids:
                dev = our_device(pid_, ids)
                assigned.append((pid_, a, dev))
                if dev:
                    by_device[dev] = names if dev not in by_device else {}   # shared device: ambiguous
        with self._lock:
            self._by_device = {d: n for d, n in by_device.items() if n}
            self._assigned = assigned
            self._assigned_new = True
        self.refreshes += 1
        self.last_error = ""

    def start(self) -> None:
        if not self.socket:
            return
        self.refresh()
        self._thread = TASKS.thread("pod-resources", self._run, self._stop)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)

    def assignments(self) -> list[dict]:
        with self._lock:
            return [{"device_id": pid_, "device": dev, "resource": a.resource, "namespace": a.namespace,
                     "pod": a.pod, "container": a.container} for pid_, a, dev in self._assigned]

    # -- cgroup and runtime metadata
    def _cached(self, cache: dict, key: str, make: Callable[[], dict]) -> dict:
        now = self.clock()
        got = cache.get(key)
        if got is not None and now - got[0] < self.refresh_s:
            return got[1]
        value = make()
        if len(cache) > 65536:
            cache.clear()
        cache[key] = (now, value)
        return value

    def for_cgroup(self, path: str) -> dict[str, str]:
        def make() -> dict:
            info = parse_cgroup_path(path)
            cid = info.get(CONTAINER_ID)
            if cid:
                meta = self._cached(self._meta, cid, lambda: read_runtime_metadata(self.metadata_dirs, cid))
                info = {**meta, **info}   # the cgroup's uid and id win over the metadata's
            return info
        return self._cached(self._cgroups, path, make)

    def for_pid(self, pid: str) -> dict[str, str]:
        def make() -> dict:
            try:
                with open(os.path.join(self.procfs, pid, "cgroup")) as f:
                    path = parse_proc_cgroup(f.read())
            except OSError:
                return {}
            return self.for_cgroup(path) if path else {}
        return self._cached(self._pids, pid, make)

    def pod_of(self, pid: str | None, cgroup: str | None, device: str | None) -> dict[str, str]:
        """Pod attributes of a process (else of a cgroup), completed from the kubelet's assignment of
        `device` for a pod's process the runtime metadata does not name, or one that has ended."""
        if pid is not None:
            info = self.for_pid(pid)
        elif cgroup is not None:
            info = self.for_cgroup(cgroup)
        else:
            return {}
        by_device = self._by_device
        if POD_NAME not in info and device in by_device:
            if not info or info.get(POD_UID):   # a pod's process, or one we cannot place
                info = {**info, **by_device[device]}
        return info

    def label_event(self, e: Event) -> Event:
        """Pod attributes on an event about a process or cgroup (a diagnosis: `process.pid`,
        `cgroup`), else about a device the kubelet assigned to a pod (changed in place); the event's
        own attributes win."""
        a = e.attributes
        info = self.pod_of(a.get("process.pid"), a.get("cgroup"), e.device)
        if not info and "process.pid" not in a and "cgroup" not in a:
            info = self._by_device.get(e.device, {})
        if info:
            e.attributes = {**info, **a}
        return e

    def label(self, samples: list[Sample]) -> list[Sample]:
        """Pod labels on the samples that carry `pid` or `cgroup` (changed in place), plus the
        device assignment samples after each pod-resources refresh."""
        for s in samples:
            lb = s.labels
            if "pid" in lb or "cgroup" in lb:
                info = self.pod_of(lb.get("pid"), lb.get("cgroup"), lb.get("device"))
                if info:
                    s.labels = {**lb, **info}
        if self._assigned_new:
            with self._lock:
                self._assigned_new = False
                current = {tuple({"device": dev or pid_, "device_plugin_id": pid_, "resource": a.resource,
                                  POD_NAME: a.pod, NAMESPACE: a.namespace, CONTAINER: a.container}.items()): 1.0
                           for pid_, a, dev in self._assigned}
                # An assignment gone since the last refresh is sent once more as 0: readers of the
                # latest refresh (the dashboards' pod labels, collector/compat_pods.py) see it end.
                for key in self._sent - current.keys():
                    current[key] = 0.0
                self._sent = {k for k, v in current.items() if v}
            now = time.time_ns()
            for key, value in current.items():
                samples.append(Sample(DEVICE_ASSIGNED, value, "1", dict(key), GAUGE, now))
        return samples


def build_pod_labeler(cfg, resources: Callable[[], list[dict]]) -> PodLabeler | None:
    """From the agent config's [k8s] table: None when off. Adds `k8s_node` (the node's name, from
    `node_name` / env XPUSENSE_K8S_NODE_NAME) to the inventory labels the agent sends."""
    k = cfg.k8s
    if not k.enabled:
        return None
    if k.node_name and "k8s_node" not in cfg.labels:
        cfg.labels["k8s_node"] = k.node_name
    p = PodLabeler(procfs=k.procfs, pod_resources_socket=k.pod_resources_socket,
                   metadata_dirs=k.metadata_dirs, refresh_s=k.refresh_s, resources=resources)
    p.start()
    return p
