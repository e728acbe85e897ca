"""docs/metrics.md "Names at each edge" is common/semconv.py's table as Markdown, with the Prometheus
names collector/prometheus.py gives each metric: the docs, the OTLP names and the Prometheus names
cannot drift apart. Every metric row of docs/metrics.md is in the table, and every table entry has a
row. After changing the table: `.venv/bin/python tests/unit/test_semconv_docs.py --write`."""

from __future__ import annotations

import pathlib
import sys

from xpusense.collector.prometheus import DCGM, NPU, prom_name
from xpusense.common import semconv
from xpusense.v1 import telemetry_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
BEGIN = "<!-- names-at-each-edge: generated from common/semconv.py by tests/unit/test_semconv_docs.py --write -->"
END = "<!-- /names-at-each-edge -->"
KIND = {"gauge": pb.GAUGE, "counter": pb.COUNTER, "histogram": pb.HISTOGRAM}


def prometheus(m: semconv.Metric) -> str:
    name = prom_name(m.wire, m.unit, KIND[m.kind]) + ("_total" if m.kind == "counter" else "")
    compat = sorted({v[0] for k, v in DCGM.items() if k[0] == m.wire} | {v[0] for k, v in NPU.items() if k[0] == m.wire})
    return f"`{name}`" + (" (compat: " + ", ".join(f"`{c}`" for c in compat) + ")" if compat else "")


DEVICE_ATTRIBUTES = ("hw.type", "hw.model", "hw.vendor", "hw.driver_version", "hw.firmware_version",
                     "hw.serial_number", "xpusense.accelerator.uuid")   # "the device's attributes" in the table


def device_attributes(hw: tuple[str, ...]) -> str:
    missing = [a for a in DEVICE_ATTRIBUTES if a not in hw]
    if set(hw) <= set(DEVICE_ATTRIBUTES) and len(missing) <= 1:
        return "the device's attributes" + (f" but `{missing[0]}`" if missing else "")
    return ", ".join(f"`{a}`" for a in hw)


def attributes(m: semconv.Metric) -> str:
    parts = []
    if m.device == semconv.ACCELERATOR:
        parts.append("device [, mig_instance] -> `hw.id`" + (" + " + device_attributes(m.hw) if m.hw else ""))
    elif m.device == semconv.SENSOR:
        parts.append("device, sensor -> `hw.id` (`gpu0/temperature/hbm`), `hw.parent`, `hw.sensor_location`")
    for wire, lab in m.labels.items():
        if not lab.to:
            parts.append(f"{wire} -> (left out)")
            continue
        text = f"{wire} -> `{lab.to}`" + (" (resource)" if lab.resource else "") + (" (int)" if lab.integer else "")
        text += f" (the wire value, where changed, in `{lab.detail}`)" if lab.detail else ""
        changed = {k: v for k, v in lab.values.items() if k != v}
        if changed:
            text += " (" + ", ".join(f"{k}: {v if v is not None else 'left out'}" for k, v in changed.items()) + ")"
        parts.append(text)
    for k, v in m.const.items():
        parts.append(f"`{k}`={v}")
    if m.states is not None:
        vals = ", ".join(f"{k}: {v or 'none'}" for k, v in m.states.values.items())
        parts.append(f"{m.states.label} -> `{m.states.attribute}` state set ({vals})")
    return "; ".join(parts)


def render() -> str:
    rows = ["| wire, collector | Prometheus | OTLP name | OTLP instrument | unit | OTLP attributes |",
            "| --- | --- | --- | --- | --- | --- |"]
    for m in semconv.METRICS:
        otlp = f"`{m.name}`" if m.name != m.wire else "same"
        if m.legacy:
            otlp += " (`legacy_names`: as on the wire)"
        rows.append(f"| {m.wire} | {prometheus(m)} | {otlp} | {m.otlp_instrument} | {m.unit} | {attributes(m)} |")
    return "\n".join([BEGIN, *rows, END])


def current(doc: str) -> str:
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[start:end]


def test_docs_table_is_the_mapping():
    doc = DOC.read_text(encoding="utf-8")
    assert BEGIN in doc and END in doc, "docs/metrics.md lacks the generated section: run this file with --write"
    assert current(doc) == render(), "docs/metrics.md is stale: .venv/bin/python tests/unit/test_semconv_docs.py --write"


def metric_rows(doc: str) -> set[str]:
    """First cells of the hand-written tables that name metrics (`a.b / c` and `a.b.1m / .5m` siblings)."""
    out = set()
    body = doc[:doc.index(BEGIN)] + doc[doc.index(END):]
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        first, *others = line.split("|")[1].strip().split(" / ")
        if "." not in first or " " in first:
            continue
        out.add(first)
        stem = first.rsplit(".", 1)[0]
        out.update(stem + (o if o.startswith(".") else "." + o) for o in others)
    return out


def test_every_documented_metric_is_in_the_mapping_and_back():
    rows = metric_rows(DOC.read_text(encoding="utf-8"))
    wire = set(semconv.BY_WIRE)
    assert not rows - wire, f"documented but not in common/semconv.py: {sorted(rows - wire)}"
    assert not wire - rows, f"in common/semconv.py but no row in docs/metrics.md: {sorted(wire - rows)}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        doc = DOC.read_text(encoding="utf-8")
        DOC.write_text(doc.replace(current(doc), render()) if BEGIN in doc else doc.rstrip("\n") + "\n\n" + render() + "\n",
                       encoding="utf-8")
    else:
        print(render())
