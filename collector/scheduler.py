"""Scheduler core: ranks the fleet's nodes for a job, from the collector's live fleet state.

It reads FleetState directly, with no polling copy: a watcher on FleetState (called on the event
loop after every Hello, inventory and stored batch) keeps one small summary per node up to date
(its devices' free HBM and `free` score, health, groups by type and interconnect domain) and files
it in an index: per kind of request and placement key (region, zone, province, encryption,
attestation), arrays of each node's fit for 1..CMAX devices and levels of its compute part. A
decision then counts what fits with C-speed passes over those arrays, and ranks by walking the
compute levels best first, stopping when no node left can beat the K-th best (`_search`); the
plain walk over every node (`_scan`) answers larger counts and is the reference it is tested
against. Staleness is read from each NodeState's last_seen_ns when a node is looked at.

A request asks for `count` devices of one type (GPU, NPU or any), each with `memory_bytes` of HBM
free, on one node (in one NVLink/HCCS domain when `same_domain`). The answer is every node that can
take it, ranked by the platform's cost-benefit matrix:

    total = (w_compute * compute + w_data * data_affinity + w_dr * disaster_tolerance
             + w_compliance * compliance) * product(penalty factors)

    compute            = value_norm * free
      value            = peak TFLOPS (catalog) / price per accelerator-hour (node label `price`)
      value_norm       = value / best value in the fleet (0.5 when TFLOPS or price is unknown)
      free             = mean over the chosen devices of mean(1 - utilisation, free HBM / HBM,
                         1 - HBM bandwidth utilisation), over the readings the device has
    data_affinity      = 1 - 0.5 * min(1, latency_ms / latency_ref_ms)
                           - 0.5 * min(1, transfer_cost / transfer_cost_ref)
                         from the region matrix in config, node region -> data region; 1 in the
                         data's region, 0 for a pair the matrix lacks; 1 when no data region is given
    disaster_tolerance = 1 - (the job's other replicas in this node's zone) / (all other replicas);
                         1 when none are given, 0.5 when the node has no `zone` label
    compliance         = 0.5 * encryption + 0.5 * attestation (node labels `encryption`,
                         `attestation`: a capability name or true counts 1, none/false/absent 0)

Hard filters (the node is left out, the answer says why): telemetry older than `stale_s`;
`allowed_regions`; data residency (region or province); required encryption/attestation; not
enough devices of the type with enough free HBM. Health, per accelerator: an XID or double-bit
ECC event within `xid_window_s`, or a health state other than OK (the newer of the
`xpusense.accelerator.health` series and the last `health` event), takes the device out; a
checkpoint request from the HBM watch within `hbm_watch_window_s` keeps the device but multiplies
the node's score by `hbm_watch_factor` when the device is among those chosen.

Chosen devices: among the node's offered devices with `memory_bytes` free, the `count` best by
`free` score, those not penalised first (the penalty applies only when a penalised one must be
taken). Memory sizes: inventory attributes say "80GB" for 80 GiB (NVML and npu-smi
sizes divided by 2^30), so "GB" is read as 2^30 bytes here and in requests alike.
"""

from __future__ import annotations

import gc
import heapq
import logging
import math
import operator
import re
import time
import tomllib
from array import array
from importlib import resources
from itertools import chain, compress, islice, repeat
from typing import Any

from xpusense.agent.config import ConfigError, Key, Table, non_negative, positive, ratio
from xpusense.v1 import scheduler_pb2 as spb

log = logging.getLogger("xpusense.collector.scheduler")

# -- the platform's cost-benefit matrix -----------------------------------------------------------

DIMENSIONS = ("compute", "data_affinity", "disaster_tolerance", "compliance")
WEIGHT_RANGES = {
    "compute": (0.30, 0.50),
    "data_affinity": (0.20, 0.30),
    "disaster_tolerance": (0.15, 0.25),
    "compliance": (0.05, 0.15),
}
DEFAULT_WEIGHTS = {"compute": 0.40, "data_affinity": 0.25, "disaster_tolerance": 0.20, "compliance": 0.15}
UNKNOWN_VALUE_NORM = 0.5    # value_norm of a device whose TFLOPS or price is unknown
NO_READINGS_FREE = 0.5      # `free` of a device with no utilisation/HBM readings yet

# Peak dense FP16 TFLOPS of Ascend NPUs, by inventory model, only where a public source gives it.
# agent/catalog/huawei.toml has no throughput figures. Ascend 910 (910A): 256 TFLOPS FP16 (Huawei's
# launch announcement of 2019-08-23 and Hot Chips 31, 2019, H. Liao, "DaVinci: A Scalable
# Architecture for Neural Network Computing": 32 cores x 4096 FP16 MACs per cycle; as quoted in
# public material). No official figure was found for the 910B family (910B1..B4) or 910C: they are
# left out, and an operator gives them in [scheduler.peak_tflops] (model = TFLOPS); until then their
# value per price counts as unknown (UNKNOWN_VALUE_NORM).
NPU_PEAK_TFLOPS = {"Ascend-910A": 256.0}


def _weight(name: str):
    lo, hi = WEIGHT_RANGES[name]

    def check(v: Any) -> str | None:
        if lo - 1e-9 <= v <= hi + 1e-9:
            return None
        hint = f" (a ratio: {v / 100:g} for {v:g}%)" if v > 1 else ""
        return f"must be between {lo:g} and {hi:g} ({lo * 100:.0f}-{hi * 100:.0f}%){hint}"
    return check


SCHEDULER_SCHEMA = {
    "weights": {k: Key((int, float), DEFAULT_WEIGHTS[k], _weight(k),
                       help=f"{k} weight, {WEIGHT_RANGES[k][0]:g}-{WEIGHT_RANGES[k][1]:g}; the four add up to 1")
                for k in DIMENSIONS},
    "xid_window_s": Key((int, float), 600.0, non_negative,
                        help="an accelerator with an XID or double-bit ECC event this recent is not offered"),
    "hbm_watch_window_s": Key((int, float), 300.0, non_negative,
                              help="an accelerator whose HBM watch asked for a checkpoint this recently is penalised"),
    "hbm_watch_factor": Key((int, float), 0.5, ratio,
                            help="score factor of a node whose chosen devices include such an accelerator"),
    "region_latency_ms": Key(Table, Table(), help='"node-region/data-region" = ms (symmetric unless both given)'),
    "region_transfer_cost": Key(Table, Table(), help='"node-region/data-region" = price per GB moved'),
    "latency_ref_ms": Key((int, float), 100.0, positive, help="latency at which the latency half of data affinity is 0"),
    "transfer_cost_ref": Key((int, float), 0.10, positive, help="price per GB at which the cost half of data affinity is 0"),
    "peak_tflops": Key(Table, Table(), help="model = dense FP16 TFLOPS, for models the catalogs lack"),
}


def check_config(cfg, where: str) -> None:
    """What the per-key checks cannot see: the weights' sum and the tables' numbers."""
    sc = cfg.scheduler
    w = vars(sc.weights)
    total = sum(w.values())
    if abs(total - 1.0) > 1e-6:
        parts = ", ".join(f"{k}={w[k]:g}" for k in DIMENSIONS)
        raise ConfigError(f"{where}: 'scheduler.weights' add up to {total:g}, not 1 ({parts}); "
                          f"change them so that they total 1 (100%)")
    for table in ("region_latency_ms", "region_transfer_cost", "peak_tflops"):
        for k, v in getattr(sc, table).items():
            key = f"scheduler.{table}.{k!r}"
            try:
                x = float(v)
            except ValueError:
                raise ConfigError(f"{where}: '{key}' must be a number, got {v!r}") from None
            if not x >= 0 or (table == "peak_tflops" and x == 0):
                raise ConfigError(f"{where}: '{key}' must be {'greater than 0' if table == 'peak_tflops' else '0 or more'}, got {v!r}")
            if table != "peak_tflops" and (k.count("/") != 1 or not all(k.split("/"))):
                raise ConfigError(f"{where}: '{key}' must be named \"node-region/data-region\"")


class PlaceError(ValueError):
    """A request the core cannot answer as asked (bad weights, missing data region...)."""


def resolve_weights(base: dict[str, float], override: spb.Weights | dict | None = None) -> dict[str, float]:
    """The configured weights with a request's overrides; each in its range and all adding up to 1."""
    w = dict(base)
    if isinstance(override, spb.Weights):
        override = {k: getattr(override, k) for k in DIMENSIONS if override.HasField(k)}
    for k, v in (override or {}).items():
        if k not in WEIGHT_RANGES:
            raise PlaceError(f"unknown weight {k!r} (known: {', '.join(DIMENSIONS)})")
        w[k] = float(v)
    for k in DIMENSIONS:
        why = _weight(k)(w[k])
        if why:
            raise PlaceError(f"weight '{k}' {why}, got {w[k]:g}")
    total = sum(w.values())
    if abs(total - 1.0) > 1e-6:
        parts = ", ".join(f"{k}={w[k]:g}" for k in DIMENSIONS)
        raise PlaceError(f"weights add up to {total:g}, not 1 ({parts}); give weights that total 1 (100%)")
    return w


# -- parsing --------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'80GB' / '64 GiB' / '32768MB' / '1073741824' -> bytes; GB means 2^30 as in the inventory."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 40GB, 64GiB, 32768MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}GiB"


def _price(text: str) -> float | None:
    m = re.search(r"[0-9]+(?:\.[0-9]+)?", text or "")
    p = float(m.group()) if m else 0.0
    return p if p > 0 else None


_NO = {"", "0", "false", "no", "none", "off", "n/a", "unsupported"}


def _capable(text: str | None) -> bool:
    return (text or "").strip().lower() not in _NO


def _nvidia_catalog() -> list[dict]:
    try:
        with resources.files("xpusense.agent").joinpath("catalog/nvidia.toml").open("rb") as f:
            return tomllib.load(f).get("gpu", [])
    except (OSError, tomllib.TOMLDecodeError):
        return []


# -- per-node summaries ---------------------------------------------------------------------------

ACCEL_TYPES = ("GPU", "NPU")
UTIL, USED, LIMIT, BW, HEALTH = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit",
                                 "xpusense.accelerator.hbm.bandwidth.utilization", "xpusense.accelerator.health")
_WATCHED = {UTIL: "util", USED: "used", LIMIT: "limit", BW: "bw"}
INF = 1 << 62
CMAX = 8      # device counts the index serves; a larger count is answered by a scan
LEVELS = 32   # levels of the compute part, for the top-K search


class Device:
    __slots__ = ("id", "type", "model", "capacity", "tflops", "domain", "util", "used", "limit", "bw",
                 "health", "free", "fscore", "parts", "penalty", "excluded", "order")

    def __init__(self, rid: str, rtype: str, model: str, capacity: float, tflops: float | None, domain: str):
        self.id, self.type, self.model = rid, rtype, model
        self.capacity, self.tflops, self.domain = capacity, tflops, domain
        self.util = self.used = self.limit = self.bw = None    # Series of FleetState, read in place
        self.health: list = []                                  # health Series (one per status label)
        self.free = capacity
        self.fscore = NO_READINGS_FREE
        self.parts: tuple = ()
        self.penalty: str | None = None             # why, when the HBM watch fired recently
        self.excluded: tuple | None = None          # (reason, detail) when not offered
        self.order: tuple = ()                      # the order devices are chosen in (Group)


class Group:
    """The offered (healthy) devices of one type on a node, or of one interconnect domain, with what
    a decision needs for any `count` precomputed. Devices are in the order they would be chosen:
    not penalised first, then by `free` score. For `count` devices of `memory` bytes each:
    free_desc[count-1] >= memory says whether enough devices fit at all; when minfree[count] >=
    memory the first `count` devices all fit and cs[count] (value_norm x their mean `free` score)
    and pen[count] (penalty factor) are the answer in O(1); otherwise `choose` walks the devices."""
    __slots__ = ("node", "type", "domain", "devices", "free_desc", "minfree", "fmean", "pen", "cs", "vn",
                 "tflops", "value", "model", "free_all", "n_all", "fitv", "lvl", "vtext")

    def __init__(self, node: "NodeSummary", rtype: str, domain: str, devs: list[Device], factor: float):
        self.node, self.type, self.domain = node, rtype, domain
        healthy = [d for d in devs if d.excluded is None]
        if len(healthy) > 1:
            healthy.sort(key=_CHOICE_ORDER)
        self.devices = healthy
        self.free_desc = sorted((d.free for d in healthy), reverse=True)
        minfree, fmean, pen = [INF], [0.0], [1.0]
        acc, f, m = 0.0, 1.0, INF
        for i, d in enumerate(healthy, 1):
            acc += d.fscore
            if d.penalty is not None:
                f = factor
            if d.free < m:
                m = d.free
            minfree.append(m)
            fmean.append(acc / i)
            pen.append(f)
        self.minfree, self.fmean, self.pen = minfree, fmean, pen
        self.free_all = sorted((d.free for d in devs), reverse=True)
        self.n_all = len(devs)
        self.model = devs[0].model
        tf = [d.tflops for d in devs]
        self.tflops = None if None in tf else min(tf)
        price = node.price
        self.value = self.tflops / price if self.tflops and price else -1.0
        self.vn = UNKNOWN_VALUE_NORM
        self.cs: list[float] = fmean   # set by rescale()
        # For the index (Bucket): per count c = 1..CMAX the free HBM of the c-th most free offered
        # device (-1: fewer offered, -2: fewer at all), and the level of cs[c] (-1: not offered).
        n, fr = len(healthy), self.free_desc
        self.fitv = array("d", [(fr[c - 1] if c <= n else (-1.0 if c <= self.n_all else -2.0))
                                for c in range(1, CMAX + 1)])
        self.lvl: list[int] = []

    def rescale(self, inv_best: float) -> None:
        self.vtext = ""   # the compute dimension's value text, made when first asked for
        self.vn = vn = self.value * inv_best if self.value >= 0 else UNKNOWN_VALUE_NORM
        self.cs = cs = [vn * f for f in self.fmean]
        n = len(cs) - 1
        self.lvl = [-1] + [(LEVELS - 1 if cs[c] >= 1.0 else int(cs[c] * LEVELS)) if c <= n else -1
                           for c in range(1, CMAX + 1)]

    def choose(self, count: int, memory: int) -> tuple[list[Device], float, float]:
        """The first `count` devices in choice order that have `memory` free: (devices, mean `free`
        score, penalty factor); fewer devices when not enough fit."""
        chosen = [d for d in self.devices if d.free >= memory][:count]
        if not chosen:
            return chosen, 0.0, 1.0
        pen = self.pen[-1] if any(d.penalty is not None for d in chosen) else 1.0
        return chosen, sum(d.fscore for d in chosen) / len(chosen), pen


_CHOICE_ORDER = operator.attrgetter("order")   # Device.order: (penalised, -free score, -free HBM)


class NodeSummary:
    """What the scheduler keeps per node. `cands[i]` is the list of groups a request looks at:
    i = type index (GPU 0, NPU 1, any 2) + 3 when the devices must share one domain."""
    __slots__ = ("ns", "node_id", "labels", "region", "zone", "province", "enc", "att", "price", "pkey",
                 "devices", "by_type", "cands", "expires_ns", "nseries", "xid", "hevent", "ckpt", "sick",
                 "value", "base", "layout")

    def __init__(self, ns):
        self.ns = ns                        # FleetState's NodeState, read in place (last_seen_ns...)
        self.node_id = ns.node_id
        self.devices: list[Device] = []
        self.by_type: dict[str, Group] = {}
        self.cands: tuple = ((),) * 6
        self.expires_ns = INF
        self.nseries = -1
        self.xid: dict[str, tuple] = {}     # device -> (time ns, detail): last XID / double-bit ECC
        self.hevent: dict[str, tuple] = {}  # device -> (time ns, ok, detail): last health event
        self.ckpt: dict[str, tuple] = {}    # device -> (time ns, detail): last checkpoint request
        self.labels: dict[str, str] = {}
        self.region = self.zone = self.province = ""
        self.enc = self.att = False
        self.price = None
        self.pkey: tuple = ()
        self.sick: list[Device] = []        # devices not offered now (d.excluded says why)
        self.value = -1.0                   # best value (TFLOPS per price) among its groups
        self.base = spb.Candidate(node_id=self.node_id)   # what every answer naming it starts from
        self.layout: list[tuple] = []       # (type index, type, devices, {domain: devices} or None)


def _domain(res, rtype: str) -> str:
    attrs = res.attributes
    if attrs.get("interconnect_domain"):
        return attrs["interconnect_domain"]
    kinds = {ic.type.lower() for ic in res.interconnects}
    if rtype == "GPU" and kinds & {"nvlink", "nvswitch"} and attrs.get("nvlink_count", "1") != "0":
        return "nvlink"
    if "hccs" in kinds:
        if res.model.startswith("Ascend-910A"):
            # Atlas 800 (9000/9010): NPUs 0-3 and 4-7 form two HCCS full-mesh groups
            # (agent/catalog/huawei.toml).
            m = re.match(r"npu(\d+)", res.id)
            return f"hccs{int(m.group(1)) // 4}" if m else "hccs"
        return "hccs"
    return f"pcie:{res.id}"   # no NVLink/HCCS: a domain of its own




class Entry:
    """A node in one pool. `g`: its one group to look at there (the common case), or None with
    `gs` the several (types for `any`, domains for same_domain), evaluated one by one."""
    __slots__ = ("node", "ns", "key", "g", "gs", "slot", "pslot", "lv")

    def __init__(self, s: "NodeSummary", key: tuple):
        self.node, self.ns, self.key = s, s.ns, key
        self.g: Group | None = None
        self.gs: list[Group] = []
        self.slot = -1                # row in its Bucket's fit (one-group nodes)
        self.pslot = -1               # row in its Pool's fit
        self.lv = [-1] * (CMAX + 1)   # per count: its level in Bucket.top, -1 when not there


NO_FIT = array("d", [-2.0] * CMAX)


class Bucket:
    """The nodes of one placement key (region, zone, province, encryption, attestation) in a pool.
    For the one-group nodes (`entries`, by slot), per count c: fit[slot * CMAX + c - 1] = free
    HBM of the c-th most free offered device (-1: fewer than c offered, -2: fewer than c at all),
    a column of which is read with C-speed slicing, map and sum; top[c][level] = the nodes whose
    compute part for c devices is in that level, walked best level first. `many`: the nodes with several groups."""
    __slots__ = ("key", "entries", "many", "fit", "top", "used", "c_b")

    def __init__(self, key: tuple):
        self.key = key
        self.entries: list[Entry] = []
        self.many: dict[str, Entry] = {}
        self.fit = array("d")   # row per slot: Group.fitv (CMAX values)
        self.top = [None] + [[{} for _ in range(LEVELS)] for _ in range(CMAX)]
        self.used = [0] * (CMAX + 1)   # per count: bit `level` set when top[c][level] has nodes
        self.c_b = 0.0          # during a decision: its placement key's part of the score

    def size(self) -> int:
        return len(self.entries) + len(self.many)


class Pool:
    """What one kind of request walks (type GPU 0, NPU 1, any 2; +3 when the devices must share a
    domain): the nodes that have such devices, in Buckets by placement key. `fit` and `singles`
    hold every one-group node's fit row once more, pool-wide, so that a decision counts the whole
    pool in one pass and only visits the buckets a filter removes."""
    __slots__ = ("buckets", "entry", "sick", "fit", "singles")

    def __init__(self):
        self.buckets: dict[tuple, Bucket] = {}
        self.entry: dict[str, Entry] = {}
        self.sick: dict[str, Entry] = {}   # nodes with a device not offered now
        self.fit = array("d")
        self.singles: list[Entry] = []


TYPE_INDEX = {spb.ACCELERATOR_GPU: 0, spb.ACCELERATOR_NPU: 1, spb.ACCELERATOR_ANY: 2}
TYPE_NAMES = (("GPU",), ("NPU",), ACCEL_TYPES)


class _Later:
    """A node id that sorts the other way: in the min-heap of the best, the larger id goes first."""
    __slots__ = ("s",)

    def __init__(self, s: str):
        self.s = s

    def __lt__(self, other: "_Later") -> bool:
        return other.s < self.s


class _Query:
    """One request while it is being decided: its terms, the running top K, counts and lists."""
    __slots__ = ("req", "ti", "ci", "same_domain", "count", "mem", "limit", "max_listed", "allowed",
                 "replicas", "data_region", "cut", "wc", "wd", "wt", "wp", "result", "th", "feasible",
                 "best_g", "counts", "listed_health", "listed_filter", "listed_fit", "stale_nodes",
                 "misfit_nodes", "filtered", "aff", "tol", "filtering")

    def __init__(self, sch: "Scheduler", req, w: dict, ti: int, now: int):
        self.req, self.ti = req, ti
        self.same_domain = req.same_domain
        self.ci = ti + 3 if self.same_domain else ti
        self.count = req.count or 1
        self.mem = req.memory_bytes
        self.limit = req.limit or 5
        self.max_listed = req.max_excluded or 10
        self.allowed = frozenset(req.allowed_regions)
        self.replicas = list(req.replica_zones)
        self.data_region = req.data_region
        self.cut = now - sch.stale_ns
        self.wc, self.wd, self.wt, self.wp = w["compute"], w["data_affinity"], w["disaster_tolerance"], w["compliance"]
        self.result: list[tuple] = []   # min-heap of (score, node id, group), at most `limit`
        self.th = -1.0                  # the K-th best score once the heap is full
        self.feasible = 0
        self.best_g = None
        self.counts: dict[str, int] = {}
        self.listed_health: list[tuple] = []
        self.listed_filter: list[tuple] = []
        self.listed_fit: list[tuple] = []
        self.stale_nodes: list = []
        self.misfit_nodes: list = []
        self.filtered: list[tuple] = []
        self.aff: dict[str, float] = {}
        self.tol: dict[str, float] = {}
        self.filtering = bool(self.allowed or req.residency or req.require_encryption or req.require_attestation)

    def offer(self, sc: float, nid: str, g) -> None:
        """Keep the best `limit`: higher score first, then the lower node id (so that the answer
        does not depend on the order nodes are looked at)."""
        r = self.result
        if len(r) < self.limit:
            heapq.heappush(r, (sc, _Later(nid), g))
            if len(r) == self.limit:
                self.th = r[0][0]
        elif sc > self.th or (sc == self.th and nid < r[0][1].s):
            heapq.heapreplace(r, (sc, _Later(nid), g))
            self.th = r[0][0]

    def count_reason(self, reason: str, n: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def note_misfit(self, reason: str, s) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        lst = self.listed_health if reason in ("xid", "unhealthy") else self.listed_fit
        if len(lst) < self.max_listed:
            lst.append((reason, s))


class Scheduler:
    """The core. Construct it on the loop thread that owns `state`; it registers itself as a watcher."""

    def __init__(self, state, cfg=None):
        if cfg is None:
            from .config import load_collector
            cfg = load_collector(None, env={})
        sc = cfg.scheduler
        self.state = state
        self.stale_ns = int(cfg.stale_s * 1e9)
        self.weights = resolve_weights(vars(sc.weights))
        self.xid_window_ns = int(sc.xid_window_s * 1e9)
        self.ckpt_window_ns = int(sc.hbm_watch_window_s * 1e9)
        self.hbm_factor = float(sc.hbm_watch_factor)
        self.latency_ref_ms = float(sc.latency_ref_ms)
        self.cost_ref = float(sc.transfer_cost_ref)
        self.latency = self._matrix(sc.region_latency_ms)
        self.cost = self._matrix(sc.region_transfer_cost)
        self.tflops_config = {k: float(v) for k, v in sc.peak_tflops.items()}
        self.catalog = _nvidia_catalog()
        self._tflops_cache: dict[str, float | None] = {}
        self.summaries: dict[str, NodeSummary] = {}
        # What a request walks: per kind of request (type GPU 0, NPU 1, any 2; +3 when the devices
        # must share a domain) a Pool of Buckets of nodes by placement key, whose part of the score
        # and whose compliance are worked out once per request for all their nodes.
        self.pools: tuple[Pool, ...] = tuple(Pool() for _ in range(6))
        self.seen_heap: list[tuple[int, str]] = []   # (last seen ns, node), see _seen
        self.seen_pushed: dict[str, int] = {}        # node -> time of its live entry in seen_heap
        self.stale_known: dict[str, NodeSummary] = {}
        self.best_value = 0.0
        self.inv_best = 0.0
        self.expiries: list[tuple[int, str]] = []   # heap: (when a node's XID/HBM-watch window ends, node)
        for n in list(state.nodes.values()):
            self._rebuild(self._summary(n), initial=True)
            self._seen(n)
        watchers = getattr(state, "watchers", None)
        if watchers is None:
            raise RuntimeError("FleetState has no `watchers` list: the scheduler cannot follow it")
        watchers.append(self.on_change)

    @staticmethod
    def _matrix(table: dict) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for k, v in table.items():
            a, b = k.split("/")
            out[(a, b)] = float(v)
        for (a, b), v in list(out.items()):
            out.setdefault((b, a), v)
        return out

    # -- following the fleet state -----------------------------------------------------------------
    def _summary(self, n) -> NodeSummary:
        s = self.summaries.get(n.node_id)
        if s is None or s.ns is not n:
            s = self.summaries[n.node_id] = NodeSummary(n)
        return s

    def on_change(self, node, batch) -> None:
        """FleetState's watcher: batch None after a Hello or a new inventory, else a stored batch."""
        try:
            self._seen(node)
            s = self.summaries.get(node.node_id)
            if s is None or batch is None:
                self._rebuild(self._summary(node))
                if batch is None:
                    return
            if batch.events:
                self._note_events(s, batch.events)
            self._refresh(s, self.state.clock())
        except Exception:   # never let the scheduler break ingest; the node keeps its last summary
            log.exception("scheduler: cannot follow node %s", node.node_id)

    def tflops(self, model: str) -> float | None:
        if model in self._tflops_cache:
            return self._tflops_cache[model]
        tf = self.tflops_config.get(model)
        if tf is None:
            spaced = model.replace("-", " ")
            tf = next((float(e["peak_tflops"]) for e in self.catalog
                       if "peak_tflops" in e and e.get("match", "\0") in spaced), None)
        if tf is None:
            tf = NPU_PEAK_TFLOPS.get(model) or NPU_PEAK_TFLOPS.get(re.sub(r"-[0-9]+$", "", model))
        self._tflops_cache[model] = tf
        return tf

    def _rebuild(self, s: NodeSummary, initial: bool = False) -> None:
        """A new inventory: devices, labels, domains; then the readings."""
        inv = s.ns.inventory
        labels = dict(inv.labels)
        s.labels = labels
        s.region, s.zone, s.province = labels.get("region", ""), labels.get("zone", ""), labels.get("province", "")
        s.enc, s.att = _capable(labels.get("encryption")), _capable(labels.get("attestation"))
        s.price = _price(labels.get("price", ""))
        s.pkey = (s.region, s.zone, s.province, s.enc, s.att)
        s.base = spb.Candidate(node_id=s.node_id, labels=labels)
        devs = []
        for r in inv.resources:
            rtype = r.type.upper()
            if rtype not in ACCEL_TYPES:
                continue
            mem = r.attributes.get("memory", "")
            try:
                cap = float(parse_memory(mem)) if mem else 0.0
            except ValueError:
                cap = 0.0
            devs.append(Device(r.id, rtype, r.model, cap, self.tflops(r.model), _domain(r, rtype)))
        s.devices = devs
        s.layout = []
        for i, t in enumerate(ACCEL_TYPES):
            tdevs = [d for d in devs if d.type == t]
            if tdevs:
                doms: dict[str, list[Device]] = {}
                for d in tdevs:
                    doms.setdefault(d.domain, []).append(d)
                s.layout.append((i, t, tdevs, doms if len(doms) > 1 else None))
        s.nseries = -1
        if initial:
            for e in reversed(s.ns.events):   # the node's recent events, oldest first
                self._note_events(s, (e,))
        old = s.value
        self._refresh(s, self.state.clock())
        s.value = max((g.value for g in s.by_type.values()), default=-1.0)
        best = self.best_value
        if s.value > best or (old >= best and s.value < old):   # the fleet's best value moved
            self.best_value = max((x.value for x in self.summaries.values()), default=0.0)
            self.inv_best = 1.0 / self.best_value if self.best_value > 0 else 0.0
            for x in self.summaries.values():
                for g in {id(g): g for gs in x.cands for g in gs}.values():
                    g.rescale(self.inv_best)
                self._file(x)

    def _file(self, s: NodeSummary) -> None:
        """Index the node's current groups in every pool (after every refresh)."""
        nid, key = s.node_id, s.pkey
        for pool, gs in zip(self.pools, s.cands):
            e = pool.entry.get(nid)
            if not gs:
                if e is not None:
                    self._unindex(pool, e)
                continue
            one = len(gs) == 1
            if e is None or e.key != key or (e.slot >= 0) != one:
                if e is not None:
                    self._unindex(pool, e)
                e = pool.entry[nid] = Entry(s, key)
                b = pool.buckets.get(key)
                if b is None:
                    b = pool.buckets[key] = Bucket(key)
                if one:
                    e.slot = len(b.entries)
                    b.entries.append(e)
                    b.fit.extend(NO_FIT)
                    e.pslot = len(pool.singles)
                    pool.singles.append(e)
                    pool.fit.extend(NO_FIT)
                else:
                    b.many[nid] = e
            else:
                b = pool.buckets[key]
            if one:
                g = e.g = gs[0]
                row = e.slot * CMAX
                b.fit[row:row + CMAX] = g.fitv
                row = e.pslot * CMAX
                pool.fit[row:row + CMAX] = g.fitv
                lv, glv = e.lv, g.lvl
                if lv != glv:
                    top = b.top
                    for c in range(1, CMAX + 1):
                        old, new = lv[c], glv[c]
                        if new != old:
                            if old >= 0:
                                d = top[c][old]
                                del d[nid]
                                if not d:
                                    b.used[c] &= ~(1 << old)
                            if new >= 0:
                                top[c][new][nid] = e
                                b.used[c] |= 1 << new
                    e.lv = glv
            else:
                e.gs = gs
            if s.sick:
                pool.sick[nid] = e
            elif nid in pool.sick:
                del pool.sick[nid]

    @staticmethod
    def _unindex(pool: Pool, e: Entry) -> None:
        nid = e.node.node_id
        b = pool.buckets[e.key]
        if e.slot >= 0:
            last = b.entries.pop()
            if last is not e:
                b.entries[e.slot] = last
                row = e.slot * CMAX
                b.fit[row:row + CMAX] = b.fit[-CMAX:]
                last.slot = e.slot
            del b.fit[-CMAX:]
            last = pool.singles.pop()
            if last is not e:
                pool.singles[e.pslot] = last
                row = e.pslot * CMAX
                pool.fit[row:row + CMAX] = pool.fit[-CMAX:]
                last.pslot = e.pslot
            del pool.fit[-CMAX:]
            e.pslot = -1
            for c in range(1, CMAX + 1):
                lv = e.lv[c]
                if lv >= 0:
                    d = b.top[c][lv]
                    del d[nid]
                    if not d:
                        b.used[c] &= ~(1 << lv)
            e.slot = -1
        else:
            del b.many[nid]
        del pool.entry[nid]
        pool.sick.pop(nid, None)
        if not b.size():
            del pool.buckets[e.key]

    def _seen(self, node) -> None:
        """Track when a node was last heard from, to find the stale ones without a scan: every
        node is in `stale_known` or has one live entry (time, node) in `seen_heap` with a time at
        or before its last_seen_ns (renewed at most every stale_s / 2, and when it comes due)."""
        nid = node.node_id
        if nid in self.stale_known:
            del self.stale_known[nid]
        t = node.last_seen_ns
        tp = self.seen_pushed.get(nid)
        if tp is None or t - tp > self.stale_ns // 2:
            heapq.heappush(self.seen_heap, (t, nid))
            self.seen_pushed[nid] = t

    def _stale(self, cut: int) -> list[NodeSummary]:
        """Every node last heard from before `cut`, as its NodeState says now."""
        h, known, pushed = self.seen_heap, self.stale_known, self.seen_pushed
        while h and h[0][0] < cut:
            t, nid = heapq.heappop(h)
            if pushed.get(nid) != t:
                continue          # superseded by a later entry
            s = self.summaries.get(nid)
            if s is None:
                continue
            seen = s.ns.last_seen_ns
            if seen < cut:
                known[nid] = s
                del pushed[nid]
            else:                 # heard from since: follow it on from there
                heapq.heappush(h, (seen, nid))
                pushed[nid] = seen
        out = []
        for nid, s in list(known.items()):
            if s.ns.last_seen_ns < cut:
                out.append(s)
            else:                 # back (a resend refreshes last_seen without a stored batch)
                del known[nid]
                heapq.heappush(h, (s.ns.last_seen_ns, nid))
                pushed[nid] = s.ns.last_seen_ns
        return out

    def _map_series(self, s: NodeSummary) -> None:
        by_id = {d.id: d for d in s.devices}
        for d in s.devices:
            d.health = []
        for ser in s.ns.series.values():
            attr = _WATCHED.get(ser.name)
            if attr is None and ser.name != HEALTH:
                continue
            d = by_id.get(ser.labels.get("device", ""))
            if d is None:
                continue
            if attr is None:
                d.health.append(ser)
            else:
                setattr(d, attr, ser)
        s.nseries = len(s.ns.series)

    def _note_events(self, s: NodeSummary, events) -> None:
        now = self.state.clock()
        for e in events:
            t = e.time_unix_nano or now
            if t > now:   # an agent clock ahead of ours: count from when it arrived
                t = now
            kind = e.type
            if kind == "xid" or kind == "ecc":
                what = f"XID {e.attributes['xid']}" if "xid" in e.attributes else (
                    "double-bit ECC error" if kind == "ecc" else "XID")
                s.xid[e.device] = (t, f"{what}: {e.message}")
            elif kind == "health":
                status = e.attributes.get("status", "")
                ok = status.upper() in ("OK", "HEALTHY") if status else e.severity == "info"
                s.hevent[e.device] = (t, ok, f"health {status or e.severity}: {e.message}")
            elif kind == "checkpoint_request":
                s.ckpt[e.device] = (t, e.message or "HBM bandwidth watch fired")

    def _refresh(self, s: NodeSummary, now: int) -> None:
        """New readings or events: each device's free HBM, `free` score and health; then the groups."""
        if len(s.ns.series) != s.nseries:
            self._map_series(s)
        expires = INF
        nan = math.nan
        for d in s.devices:
            d.excluded = d.penalty = None
            if s.xid or s.hevent or s.ckpt or d.health:
                expires = self._health(s, d, now, expires)
            lim = d.limit.value if d.limit is not None else nan
            total = lim if lim > 0 else d.capacity    # NaN > 0 is False
            used = d.used.value if d.used is not None else nan
            free = total - used if used >= 0 else total
            free = d.free = free if free > 0 else 0.0
            u = d.util.value if d.util is not None else nan
            b = d.bw.value if d.bw is not None else nan
            acc, k = 0.0, 0
            if u >= 0:
                acc += 1.0 - (u if u < 1.0 else 1.0)
                k += 1
            if used >= 0 and total > 0:
                acc += free / total
                k += 1
            if b >= 0:
                acc += 1.0 - (b if b < 1.0 else 1.0)
                k += 1
            fs = d.fscore = acc / k if k else NO_READINGS_FREE
            d.parts = (u, free, total, b)
            d.order = (d.penalty is not None, -fs, -free)
        factor, inv_best = self.hbm_factor, self.inv_best
        by_type: dict[str, Group] = {}
        per_type: list[list[Group]] = [[], []]
        per_domain: list[list[Group]] = [[], []]
        for i, t, devs, doms in s.layout:
            g = by_type[t] = Group(s, t, "", devs, factor)
            g.rescale(inv_best)
            per_type[i].append(g)
            if doms is None:
                g.domain = devs[0].domain
                per_domain[i].append(g)
            else:
                for name, ds in doms.items():
                    dg = Group(s, t, name, ds, factor)
                    dg.rescale(inv_best)
                    per_domain[i].append(dg)
        s.by_type = by_type
        s.cands = (per_type[0], per_type[1], per_type[0] + per_type[1],
                   per_domain[0], per_domain[1], per_domain[0] + per_domain[1])
        s.sick = [d for d in s.devices if d.excluded is not None]
        if expires != s.expires_ns:
            s.expires_ns = expires
            if expires < INF:
                heapq.heappush(self.expiries, (expires, s.node_id))
        self._file(s)

    def _health(self, s: NodeSummary, d: Device, now: int, expires: int) -> int:
        did = d.id
        x = s.xid.get(did) if s.xid else None
        if x is not None and now - x[0] < self.xid_window_ns:
            d.excluded = ("xid", f"{x[1]} ({(now - x[0]) / 1e9:.0f} s ago)")
            expires = min(expires, x[0] + self.xid_window_ns)
        else:
            ht, last = -1, None
            for ser in d.health:
                if ser.time_ns > ht:
                    ht, last = ser.time_ns, ser
            ev = s.hevent.get(did) if s.hevent else None
            if ev is not None and ev[0] > ht:
                if not ev[1]:
                    d.excluded = ("unhealthy", ev[2])
            elif last is not None and last.value < 1.0:
                d.excluded = ("unhealthy", f"health {last.labels.get('status', 'not OK')} "
                                           f"(xpusense.accelerator.health = {last.value:g})")
        c = s.ckpt.get(did) if s.ckpt else None
        if c is not None and now - c[0] < self.ckpt_window_ns:
            d.penalty = f"HBM watch asked for a checkpoint {(now - c[0]) / 1e9:.0f} s ago: {c[1]}"
            expires = min(expires, c[0] + self.ckpt_window_ns)
        return expires

    def _expire(self, now: int) -> None:
        """Windows (XID, HBM watch) that ended since the last decision: refresh those nodes."""
        h = self.expiries
        while h and h[0][0] <= now:
            _, nid = heapq.heappop(h)
            s = self.summaries.get(nid)
            if s is not None and s.expires_ns <= now:
                self._refresh(s, now)

    # -- deciding ------------------------------------------------------------------------------------
    def _affinity(self, region: str, data_region: str) -> tuple[float, str]:
        if not data_region:
            return 1.0, "no data region in the request"
        if not region:
            return 0.0, "node has no region label"
        if region == data_region:
            return 1.0, f"data in the node's region {region}"
        lat = self.latency.get((region, data_region))
        cost = self.cost.get((region, data_region))
        if lat is None and cost is None:
            return 0.0, f"{region} -> {data_region}: not in the region matrix"
        lat_part = 1.0 if lat is None else min(1.0, lat / self.latency_ref_ms)
        cost_part = 1.0 if cost is None else min(1.0, cost / self.cost_ref)
        detail = (f"{region} -> {data_region}: "
                  + ("latency unknown" if lat is None else f"{lat:g} ms (0 at {self.latency_ref_ms:g})")
                  + ", " + ("transfer cost unknown" if cost is None else f"{cost:g}/GB (0 at {self.cost_ref:g})"))
        return 1.0 - 0.5 * lat_part - 0.5 * cost_part, detail

    @staticmethod
    def _tolerance(zone: str, replicas) -> tuple[float, str]:
        if not replicas:
            return 1.0, "no other replicas given"
        if not zone:
            return 0.5, "node has no zone label"
        same = sum(1 for z in replicas if z == zone)
        return 1.0 - same / len(replicas), f"{same} of {len(replicas)} other replicas in zone {zone}"

    @staticmethod
    def _compliance(s: NodeSummary) -> tuple[float, str]:
        enc, att = s.labels.get("encryption", ""), s.labels.get("attestation", "")
        return (0.5 * s.enc + 0.5 * s.att,
                f"encryption {enc if s.enc else 'none'}, attestation {att if s.att else 'none'}")

    @staticmethod
    def _filter(key: tuple, req, allowed) -> str | None:
        """Hard filters on a placement key (region, zone, province, encryption, attestation)."""
        region, _, province, enc, att = key
        if allowed and region not in allowed:
            return "region"
        res = req.residency
        if res == spb.RESIDENCY_REGION and region != req.data_region:
            return "residency"
        if res == spb.RESIDENCY_PROVINCE and (not province or province != req.data_province):
            return "residency"
        if req.require_encryption and not enc:
            return "encryption"
        if req.require_attestation and not att:
            return "attestation"
        return None

    def place(self, req: spb.PlaceRequest, scan: bool = False) -> spb.PlaceReply:
        """Rank the fleet for one request. Runs on the loop thread that owns the state, in one go.
        `scan`: walk every node (the reference the indexed search is tested against).

        The cyclic garbage collector is held off while deciding: a collection that falls due (the
        fleet state's history grows by tens of thousands of objects a second) then runs at the next
        allocation after the decision, on the ingest path, instead of adding milliseconds here."""
        if not gc.isenabled():
            return self._place(req, scan)
        gc.disable()
        try:
            return self._place(req, scan)
        finally:
            gc.enable()

    def _place(self, req: spb.PlaceRequest, scan: bool) -> spb.PlaceReply:
        t0 = time.perf_counter_ns()
        w = self.weights if not req.HasField("weights") else resolve_weights(self.weights, req.weights)
        if req.residency == spb.RESIDENCY_REGION and not req.data_region:
            raise PlaceError("residency REGION needs the data region (data_region, --data-region)")
        if req.residency == spb.RESIDENCY_PROVINCE and not req.data_province:
            raise PlaceError("residency PROVINCE needs the data province (data_province, --data-province)")
        ti = TYPE_INDEX.get(req.accelerator)
        if ti is None:
            raise PlaceError(f"unknown accelerator type {req.accelerator}")
        now = self.state.clock()
        if self.expiries and self.expiries[0][0] <= now:
            self._expire(now)
        q = _Query(self, req, w, ti, now)
        if scan or q.count > CMAX:
            self._scan(q)
        else:
            self._search(q)
        reply = spb.PlaceReply(nodes_total=len(self.summaries), nodes_feasible=q.feasible, time_unix_nano=now)
        rw = reply.weights
        rw.compute, rw.data_affinity, rw.disaster_tolerance, rw.compliance = q.wc, q.wd, q.wt, q.wp
        dims_by_key: dict[tuple, list] = {}
        for score, _, g in sorted(q.result, key=lambda x: (-x[0], x[1].s)):
            self._candidate(reply.candidates.add(), score, g, q.count, q.mem, w, q.data_region, q.replicas,
                            q.same_domain, dims_by_key)
        self._exclusions(reply, q)
        reply.decision_us = (time.perf_counter_ns() - t0) / 1e3
        return reply

    def _bucket_const(self, q: "_Query", key: tuple) -> float:
        """The part of the score a node's placement key decides: data affinity, disaster
        tolerance, compliance (each worked out once per region / zone in a decision)."""
        region, zone, _, enc, att = key
        aff = q.aff.get(region)
        if aff is None:
            aff = q.aff[region] = self._affinity(region, q.data_region)[0]
        tol = q.tol.get(zone)
        if tol is None:
            tol = q.tol[zone] = self._tolerance(zone, q.replicas)[0]
        return q.wd * aff + q.wt * tol + q.wp * (0.5 * enc + 0.5 * att)

    def _many(self, q: "_Query", e: Entry, c_b: float) -> float:
        """The best score over a node's several groups; -1 when none can take the job."""
        best, k, mem, count = -1.0, q.count - 1, q.mem, q.count
        for g in e.gs:
            fr = g.free_desc
            if len(fr) > k and fr[k] >= mem:
                _, f, p = g.choose(count, mem)
                sc = (c_b + q.wc * g.vn * f) * p
                if sc > best:
                    best, q.best_g = sc, g
        return best

    def _scan(self, q: "_Query") -> None:
        """Every node of the pool, one by one: O(1) each for the one-group nodes."""
        count, k, mem, cut, wc = q.count, q.count - 1, q.mem, q.cut, q.wc
        stale, misfit = q.stale_nodes, q.misfit_nodes
        for key, b in self.pools[q.ci].buckets.items():
            why = self._filter(key, q.req, q.allowed)
            if why is not None:
                q.filtered.append((why, b))
                continue
            c_b = self._bucket_const(q, key)
            for e in b.entries:
                if e.ns.last_seen_ns < cut:
                    stale.append(e.node)
                    continue
                g = e.g
                fr = g.free_desc
                if len(fr) <= k or fr[k] < mem:
                    misfit.append(e.node)
                    continue
                if g.minfree[count] >= mem:            # the `count` best devices all fit
                    sc = (c_b + wc * g.cs[count]) * g.pen[count]
                else:
                    _, f, p = g.choose(count, mem)
                    sc = (c_b + wc * g.vn * f) * p
                q.feasible += 1
                q.offer(sc, e.node.node_id, g)
            for e in b.many.values():
                if e.ns.last_seen_ns < cut:
                    stale.append(e.node)
                    continue
                sc = self._many(q, e, c_b)
                if sc < 0.0:
                    misfit.append(e.node)
                else:
                    q.feasible += 1
                    q.offer(sc, e.node.node_id, q.best_g)
        for why, b in q.filtered:   # a stale node is counted as stale, whatever its region
            nodes = [e.node for e in b.entries] + [e.node for e in b.many.values()]
            fresh = [s for s in nodes if s.ns.last_seen_ns >= cut]
            stale += [s for s in nodes if s.ns.last_seen_ns < cut]
            if fresh:
                q.count_reason(why, len(fresh))
                q.listed_filter += [(why, s) for s in fresh[:q.max_listed]]
        if stale:
            q.count_reason("stale", len(stale))
            q.listed_health += [("stale", s) for s in stale[:q.max_listed]]
        for s in misfit:
            reason = self._classify(s, q.ti, count, mem, q.same_domain)
            q.note_misfit(reason, s)

    def _search(self, q: "_Query") -> None:
        """The indexed decision: counts from the pool-wide fit arrays (C-speed passes), corrected
        for the stale nodes and the buckets a filter removes; the ranking from the best compute
        levels down, stopping as soon as no node left can beat the K-th best."""
        count, mem, cut, wc = q.count, q.mem, q.cut, q.wc
        k = count - 1
        pool = self.pools[q.ci]
        ge = operator.ge
        pcol = pool.fit[k::CMAX]
        fitting = sum(map(ge, pcol, repeat(mem)))   # one-group nodes with `count` devices that fit
        small = pcol.count(-2.0)                    # ... with fewer than `count` devices at all
        n_single = len(pool.singles)
        stale_by_key: dict[tuple, list[Entry]] = {}
        for s in self._stale(cut):
            e = pool.entry.get(s.node_id)
            if e is None:
                continue
            stale_by_key.setdefault(e.key, []).append(e)
            if e.pslot >= 0:
                n_single -= 1
                v = pcol[e.pslot]
                if v >= mem:
                    fitting -= 1
                elif v == -2.0:
                    small -= 1
        search: list[tuple] = []
        seq = 0
        filtered_keys: set[tuple] = set()
        typefit_classified = 0   # same_domain: misfits classified one by one that fit as a type
        filtering = q.filtering
        for key, b in pool.buckets.items():
            if filtering:
                why = self._filter(key, q.req, q.allowed)
                if why is not None:
                    filtered_keys.add(key)
                    st = stale_by_key.get(key, ())
                    n = b.size() - len(st)
                    if not n:
                        continue
                    q.count_reason(why, n)
                    room = q.max_listed - len(q.listed_filter)
                    if room > 0:
                        stale_ids = {e.node.node_id for e in st}
                        q.listed_filter += islice(((why, e.node) for e in chain(b.entries, b.many.values())
                                                   if e.node.node_id not in stale_ids), room)
                    if b.entries:      # take its fresh one-group nodes out of the pool-wide counts
                        bcol = b.fit[k::CMAX]
                        f_b = sum(map(ge, bcol, repeat(mem)))
                        s_b = bcol.count(-2.0)
                        n_b = len(b.entries)
                        for e in st:
                            if e.slot >= 0:
                                n_b -= 1
                                v = bcol[e.slot]
                                if v >= mem:
                                    f_b -= 1
                                elif v == -2.0:
                                    s_b -= 1
                        fitting -= f_b
                        small -= s_b
                        n_single -= n_b
                    continue
            c_b = b.c_b = self._bucket_const(q, key)
            lvl = b.used[count].bit_length() - 1     # the best non-empty level
            if lvl >= 0:
                seq += 1
                search.append((-(c_b + wc * (lvl + 1) / LEVELS), seq, lvl, b))
            if not b.many:
                continue
            for e in b.many.values():
                if e.ns.last_seen_ns < cut:
                    continue
                sc = self._many(q, e, c_b)
                if sc < 0.0:
                    q.note_misfit(self._classify(e.node, q.ti, count, mem, q.same_domain), e.node)
                    typefit_classified += q.same_domain and self._typefit(e.node, q)
                else:
                    q.feasible += 1
                    q.offer(sc, e.node.node_id, q.best_g)
        q.feasible += fitting
        if small:
            q.count_reason("count", small)
        misfit_fit = n_single - fitting - small   # too few offered devices with the memory free
        st_all = [e for v in stale_by_key.values() for e in v]
        if st_all:
            q.count_reason("stale", len(st_all))
            q.listed_health += [("stale", e.node) for e in st_all[:q.max_listed]]
        # Best compute level first, across buckets; bound = c_b + wc x the level's top.
        heapq.heapify(search)
        limit = q.limit
        result = q.result
        while search:
            negb, _, lvl, b = heapq.heappop(search)
            if len(result) >= limit and -negb < q.th:
                break
            c_b = b.c_b
            for e in b.top[count][lvl].values():
                if pcol[e.pslot] < mem or e.ns.last_seen_ns < cut:
                    continue
                g = e.g
                if g.minfree[count] >= mem:
                    sc = (c_b + wc * g.cs[count]) * g.pen[count]
                else:
                    _, f, p = g.choose(count, mem)
                    sc = (c_b + wc * g.vn * f) * p
                q.offer(sc, e.node.node_id, g)
            lvl = (b.used[count] & ((1 << lvl) - 1)).bit_length() - 1   # the next non-empty level down
            if lvl >= 0:
                seq += 1
                heapq.heappush(search, (-(c_b + wc * (lvl + 1) / LEVELS), seq, lvl, b))
        # The misfits: health first (the few nodes with a device out), then domain, memory.
        for nid, e in pool.sick.items():
            if e.pslot < 0 or e.key in filtered_keys or e.ns.last_seen_ns < cut:
                continue
            v = pcol[e.pslot]
            if v >= mem or v == -2.0:
                continue
            reason = self._classify(e.node, q.ti, count, mem, q.same_domain)
            q.note_misfit(reason, e.node)
            misfit_fit -= 1
            typefit_classified += q.same_domain and self._typefit(e.node, q)
        if q.same_domain and misfit_fit:
            domain = self._domain_misfits(q, filtered_keys, stale_by_key) - typefit_classified
            if domain:
                q.count_reason("domain", domain)
                misfit_fit -= domain
        if misfit_fit:
            q.count_reason("memory", misfit_fit)
        # A few of the fit misfits to show: the misfit rows of the pool, found at C speed.
        unlisted = sum(q.counts.get(r, 0) for r in ("count", "domain", "memory")) - len(q.listed_fit)
        room = q.max_listed - len(q.listed_health) - len(q.listed_filter)   # listed before these
        if unlisted > 0 and len(q.listed_fit) < room:
            shown = {s.node_id for _, s in q.listed_fit}
            singles = pool.singles
            for slot in compress(range(len(pcol)), map(operator.lt, pcol, repeat(mem))):
                e = singles[slot]
                if e.key in filtered_keys or e.ns.last_seen_ns < cut or e.node.node_id in shown:
                    continue
                if e.node.sick or q.same_domain:
                    reason = self._classify(e.node, q.ti, count, mem, q.same_domain)
                else:
                    reason = "count" if pcol[slot] == -2.0 else "memory"
                if reason not in ("xid", "unhealthy"):
                    q.listed_fit.append((reason, e.node))
                    if len(q.listed_fit) >= room:
                        break

    @staticmethod
    def _typefit(s: NodeSummary, q: "_Query") -> bool:
        k = q.count - 1
        return any(len(g.free_desc) > k and g.free_desc[k] >= q.mem for g in s.cands[q.ti])

    def _domain_misfits(self, q: "_Query", filtered_keys, stale_by_key) -> int:
        """same_domain: nodes whose devices fit as a type but not within one domain = the nodes that
        fit at the type level (pool ci - 3) less those feasible in one domain."""
        tpool = self.pools[q.ci - 3]
        count, mem, cut = q.count, q.mem, q.cut
        k = count - 1
        ge = operator.ge
        tcol = tpool.fit[k::CMAX]
        fit_t = sum(map(ge, tcol, repeat(mem)))
        for v in stale_by_key.values():
            for e in v:
                te = tpool.entry.get(e.node.node_id)
                if te is not None and te.pslot >= 0 and tcol[te.pslot] >= mem:
                    fit_t -= 1
        for key, b in tpool.buckets.items():
            if key in filtered_keys:
                if b.entries:
                    bcol = b.fit[k::CMAX]
                    fit_t -= sum(map(ge, bcol, repeat(mem)))
                    for e in stale_by_key.get(key, ()):   # already taken out above
                        te = tpool.entry.get(e.node.node_id)
                        if te is not None and te.slot >= 0 and bcol[te.slot] >= mem:
                            fit_t += 1
                continue
            for e in b.many.values():
                if e.ns.last_seen_ns >= cut and any(len(g.free_desc) > k and g.free_desc[k] >= mem
                                                    for g in e.gs):
                    fit_t += 1
        return fit_t - q.feasible

    def _value_text(self, g: Group) -> str:
        if g.vtext:
            return g.vtext
        g.vtext = self._make_value_text(g)
        return g.vtext

    def _make_value_text(self, g: Group) -> str:
        if g.value >= 0:
            return (f"{g.tflops:g} TFLOPS / price {g.node.price:g} per accelerator-hour = {g.value:.1f} "
                    f"(fleet best {self.best_value:.1f}) -> {g.vn:.2f}")
        why = [] if g.tflops else [f"no peak TFLOPS for {g.model} (catalog or [scheduler.peak_tflops])"]
        if not g.node.price:
            why.append("no price label")
        return f"value per price unknown ({'; '.join(why)}) -> {g.vn:g}"

    def _candidate(self, c: spb.Candidate, score, g: Group, count, mem, w, data_region, replicas,
                   same_domain, dims_by_key: dict) -> None:
        s = g.node
        chosen, free, _ = g.choose(count, mem)
        c.CopyFrom(s.base)
        c.score = score
        c.devices.extend([d.id for d in chosen])
        c.accelerator_type = g.type
        c.model = g.model
        if same_domain:
            c.domain = g.domain
        us = [d.parts[0] for d in chosen if d.parts and d.parts[0] == d.parts[0]]
        bs = [d.parts[3] for d in chosen if d.parts and d.parts[3] == d.parts[3]]
        reads = (f"util {sum(us) / len(us):.0%}" if us else "util -",
                 f"HBM free >= {gib(min(d.free for d in chosen))}",
                 f"HBM bandwidth {sum(bs) / len(bs):.0%}" if bs else "HBM bandwidth -")
        cc = g.vn * free
        c.dimensions.add(dimension="compute", score=cc, weight=w["compute"], weighted=cc * w["compute"],
                         detail=f"{self._value_text(g)}; x free {free:.2f} (the chosen: {', '.join(reads)})")
        rest = dims_by_key.get(s.pkey)
        if rest is None:   # the same for every node of this placement key
            D = spb.DimensionScore
            ca, da = self._affinity(s.region, data_region)
            ct, dt = self._tolerance(s.zone, replicas)
            cp, dp = self._compliance(s)
            rest = dims_by_key[s.pkey] = [
                D(dimension="data_affinity", score=ca, weight=w["data_affinity"], weighted=ca * w["data_affinity"],
                  detail=da),
                D(dimension="disaster_tolerance", score=ct, weight=w["disaster_tolerance"],
                  weighted=ct * w["disaster_tolerance"], detail=dt),
                D(dimension="compliance", score=cp, weight=w["compliance"], weighted=cp * w["compliance"],
                  detail=dp)]
        c.dimensions.extend(rest)
        for d in chosen:
            if d.penalty is not None:
                c.penalties.add(reason="hbm_watch", device=d.id, factor=self.hbm_factor, detail=d.penalty)
        for d in s.sick:
            if d.type == g.type:
                c.excluded_devices.add(device=d.id, reason=d.excluded[0], detail=d.excluded[1])

    def _exclusions(self, reply, q: _Query) -> None:
        """Every excluded node counted by reason; the first `max_excluded` listed: health (stale,
        XID, unhealthy), then compliance, then fit (count, domain, memory)."""
        nodes_with_type = len(self.pools[q.ti].entry)
        if nodes_with_type < len(self.summaries):
            q.count_reason("type", len(self.summaries) - nodes_with_type)   # counted, not listed
        health = sorted(q.listed_health, key=lambda x: x[0] != "stale")
        types = TYPE_NAMES[q.ti]
        for reason, s in (health + q.listed_filter + q.listed_fit)[:q.max_listed]:
            e = reply.excluded.add(node_id=s.node_id, reason=reason,
                                   detail=self._detail(s, reason, reply.time_unix_nano, types, q.count, q.mem))
            for d in s.sick:
                if d.type in types:
                    e.devices.add(device=d.id, reason=d.excluded[0], detail=d.excluded[1])
        for key, v in q.counts.items():
            if v:
                reply.excluded_counts[key] = v

    @staticmethod
    def _classify(s: NodeSummary, ti: int, count: int, mem: int, same_domain: bool) -> str:
        """Why a node that passed the filters cannot take the job: health first."""
        groups = s.cands[ti]
        if s.sick:
            for g in groups:
                fa = g.free_all
                if len(fa) >= count and fa[count - 1] >= mem and any(d.type == g.type for d in s.sick):
                    return "xid" if any(d.excluded[0] == "xid" for d in s.sick) else "unhealthy"
        if max(g.n_all for g in groups) < count:
            return "count"
        if same_domain and any(len(g.free_desc) >= count and g.free_desc[count - 1] >= mem for g in groups):
            return "domain"
        return "memory"

    def _detail(self, s: NodeSummary, reason: str, now: int, types, count, mem) -> str:
        groups = [s.by_type[t] for t in types if t in s.by_type]
        if reason == "stale":
            age = (now - s.ns.last_seen_ns) / 1e9 if s.ns.last_seen_ns else math.inf
            return f"no telemetry for {age:.1f} s (stale after {self.stale_ns / 1e9:g} s)"
        if reason in ("xid", "unhealthy"):
            sick = [d for d in s.sick if d.type in types]
            return (f"{len(sick)} accelerator(s) not offered ({', '.join(d.id for d in sick)}); "
                    f"the others cannot take the job")
        if reason == "count":
            g = max(groups, key=lambda g: g.n_all)
            return f"{g.n_all} {g.type} on the node, {count} asked"
        if reason == "domain":
            return f"no {count} fitting accelerators share one NVLink/HCCS domain"
        if reason == "memory":
            best = max(g.free_all[min(count, len(g.free_all)) - 1] for g in groups)
            nth = "the most free has" if count == 1 else f"the {count} most free have at least"
            return f"{count} device(s) with {gib(mem)} free needed; {nth} {gib(best)}"
        return {"region": f"region {s.region or '(no label)'} is not among the allowed regions",
                "residency": f"data may not leave its region/province; node is in region "
                             f"{s.region or '(no label)'}, province {s.province or '(no label)'}",
                "encryption": "no encryption capability (label `encryption`)",
                "attestation": "no attestation capability (label `attestation`)"}.get(reason, reason)
