"""Prometheus names for whatever a node sends, and one scrape's metric families kept valid.

Native names: the OpenTelemetry name with dots as underscores and the unit as a suffix; labels are
the series' labels with dots as underscores. A node may send any name and label key, and one line
Prometheus cannot parse fails the whole scrape (every node's series, `up` 0), so what Prometheus
would refuse is renamed or left out here by fixed rules (docs/export.md "Names Prometheus
accepts"), each time counted by reason (REASONS; the collector writes the counts as
`xpusense_collector_prometheus_sanitized_total{reason}`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

from xpusense.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:
    from collections.abc import Mapping

    from prometheus_client.metrics_core import Metric

UNIT_SUFFIX = {"By": "bytes", "s": "seconds", "ms": "milliseconds", "ns": "nanoseconds", "W": "watts",
               "J": "joules", "Cel": "celsius", "Hz": "hertz", "By/s": "bytes_per_second", "V": "volts",
               "TFLOP/J": "teraflops_per_joule", "1": "ratio"}

# Labels the exposition writes itself (`node`, `host_name`; `le`, `quantile` of histograms and
# summaries) or that Prometheus adds at scrape (`job`, `instance`): a series' own label of that name
# is written `exported_<name>`, as Prometheus renames a scraped `job`.
EXPORTER_LABELS = frozenset({"node", "host_name", "le", "quantile", "job", "instance"})

# reason -> what it counts (each is counted per scrape, for each label or series it applies to).
REASONS = {
    "label_renamed": "label keys renamed: characters Prometheus does not accept, a leading digit or `__`, "
                     "or the name of a label the exporter writes",
    "label_empty": "empty label keys (left out)",
    "label_merged": "label keys that became the same name (one label, the values joined with `;`)",
    "name_renamed": "metric names renamed: characters Prometheus does not accept (beyond dots) or a leading digit",
    "name_empty": "series with no name left (left out)",
    "name_taken": "series whose name another family has: another type, or one of the collector's own (left out)",
    "series_duplicate": "series equal to one already written once renamed (left out)",
}

_BAD = re.compile(r"[^a-zA-Z0-9_]")
_SAMPLES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "unknown": ("",)}


class Tally:
    """What one scrape renamed or left out: a count per reason, and the first case of each; and the
    label and metric names it worked out (memos for the scrape: a fleet repeats its names)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}
        self.where: tuple[str, str] | None = None   # the series being written: (name, node), for `first`
        self.keys: dict[str, tuple[str, str | None]] = {}
        self.names: dict[tuple[str, str, int], tuple[str, str | None]] = {}

    def hit(self, reason: str, what: str) -> None:
        self.counts[reason] += 1
        if reason not in self.first:
            self.first[reason] = f"{what} of {self.where[0]!r} on node {self.where[1]!r}" if self.where else what


def label_key(key: str, reserved: frozenset[str] = EXPORTER_LABELS) -> tuple[str, str | None]:
    """The Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*) for a series' label `key`, and the REASONS
    entry when it is more than dots as underscores (None otherwise). An empty name: left out."""
    if not key:
        return "", "label_empty"
    name = key.replace(".", "_")
    why = None
    if _BAD.search(name):
        name, why = _BAD.sub("_", name), "label_renamed"
    if name[0].isdigit():
        name, why = "key_" + name, "label_renamed"      # as OpenTelemetry's Prometheus translation
    elif name.startswith("__"):
        name, why = "key" + name, "label_renamed"       # `__` names are Prometheus' own
    if name in reserved:
        name, why = "exported_" + name, "label_renamed"
    return name, why


def prom_labels(labels: Mapping[str, str], reserved: frozenset[str] = EXPORTER_LABELS,
                tally: Tally | None = None) -> dict[str, str]:
    """A series' labels as Prometheus labels (label_key); keys that become one name are one label
    whose value is their values joined with `;`, in the order of the keys (sorted)."""
    memo = tally.keys if tally is not None and reserved is EXPORTER_LABELS else {}
    out: dict[str, str] = {}
    met = False
    for k, v in labels.items():
        got = memo.get(k)
        if got is None:
            got = memo[k] = label_key(k, reserved)
        name, why = got
        if why is not None and tally is not None:
            tally.hit(why, f"label key {k!r}")
        if name:
            met = met or name in out
            out[name] = v
    if met:
        joined: dict[str, list[tuple[str, str]]] = {}
        for k, v in labels.items():
            name = memo[k][0]
            if name:
                joined.setdefault(name, []).append((k, v))
        for name, kv in joined.items():
            if len(kv) > 1:
                out[name] = ";".join(v for _, v in sorted(kv))
                if tally is not None:
                    tally.hit("label_merged", "label keys " + ", ".join(repr(k) for k, _ in sorted(kv)))
    return out


def prom_name(name: str, unit: str, kind: int, tally: Tally | None = None) -> str:
    """The family name of a series: dots as underscores, the unit as a suffix, a counter without
    its `_total` (the exposition writes its sample as `<name>_total`); "" when no name is left."""
    key = (name, unit, kind)
    got = tally.names.get(key) if tally is not None else None
    if got is None:
        got = _prom_name(name, unit, kind)
        if tally is not None:
            tally.names[key] = got
    base, why = got
    if why is not None and tally is not None:
        tally.hit(why, f"metric name {name!r} (unit {unit!r})")
    return base


def _prom_name(name: str, unit: str, kind: int) -> tuple[str, str | None]:
    base = name.replace(".", "_")
    renamed = False
    if _BAD.search(base):
        base, renamed = _BAD.sub("_", base), True
    if not base:
        return "", "name_empty"
    if unit.startswith("{") or not unit:
        suffix = ""
    elif unit in UNIT_SUFFIX:
        suffix = UNIT_SUFFIX[unit]
    else:
        suffix = unit
        if _BAD.search(suffix):
            suffix, renamed = _BAD.sub("_", suffix), True
    if suffix == "ratio" and kind != pb.GAUGE:
        suffix = ""
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if base[0].isdigit():
        base, renamed = "_" + base, True
    if kind == pb.COUNTER and base.endswith("_total") and len(base) > len("_total"):
        base = base[: -len("_total")]
    return base, "name_renamed" if renamed else None


class Families:
    """The metric families of one scrape. A family takes its name and every name its samples are
    written under (a counter `x`: `x` and `x_total`; a histogram `x`: `x`, `x_bucket`, `x_count`,
    `x_sum`); a series whose family needs a name another family has (another type, or one the
    collector keeps for itself with `reserve`) is left out, and so is a series whose labels equal
    one already written in its family (labels with empty values do not count: Prometheus reads
    them as absent). First come, first written: the callers' order decides."""

    def __init__(self, tally: Tally):
        from prometheus_client.metrics_core import Metric
        self.new_metric = Metric
        self.tally = tally
        self.metrics: dict[str, Metric] = {}
        self.kinds: dict[str, tuple[str, bool]] = {}   # family -> (type, the collector's own)
        self.taken: dict[str, str] = {}                # every name written -> its family
        self.written: dict[str, set[frozenset[tuple[str, str]]]] = {}

    def reserve(self, name: str, kind: str) -> None:
        """Keep `name` for the collector's own family of type `kind` (written by `add(..., own=True)`
        or apart from this object)."""
        if not self._claim(name, kind, True):
            raise ValueError(f"Prometheus family {name} ({kind}): the name is taken")

    def _claim(self, name: str, kind: str, own: bool) -> bool:
        held = self.kinds.get(name)
        if held is not None:
            return held == (kind, own)
        names = (name, *(name + s for s in _SAMPLES[kind]))
        if any(n in self.taken for n in names):
            return False
        for n in names:
            self.taken[n] = name
        self.kinds[name] = (kind, own)
        return True

    def add(self, name: str, kind: str, help_: str, labels: dict[str, str], value: float,
            hist: tuple[list[tuple[str, float]], float, float] | None = None, own: bool = False) -> bool:
        """One series (a histogram's `hist`: ([(le, cumulative count)], count, sum)); False when
        left out (counted)."""
        if not self._claim(name, kind, own):
            self.tally.hit("name_taken", f"{kind} {name!r}")
            return False
        key = frozenset(labels.items() if "" not in labels.values() else ((k, v) for k, v in labels.items() if v))
        seen = self.written.setdefault(name, set())
        if key in seen:
            self.tally.hit("series_duplicate", f"series {name}{dict(sorted(labels.items()))}")
            return False
        seen.add(key)
        m = self.metrics.get(name)
        if m is None:
            m = self.metrics[name] = self.new_metric(name, help_, kind)
        if kind == "counter":
            m.add_sample(name + "_total", labels, value)
        elif kind == "histogram":
            assert hist is not None
            buckets, total, sum_ = hist
            for le, c in buckets:
                m.add_sample(name + "_bucket", {**labels, "le": le}, c)
            m.add_sample(name + "_count", labels, total)
            m.add_sample(name + "_sum", labels, sum_)
        else:
            m.add_sample(name, labels, value)
        return True
