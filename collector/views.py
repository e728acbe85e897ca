"""What `nodes` and `top` show: the Query API's reply pages merged, turned into plain dicts and a
terminal table."""

from __future__ import annotations

import datetime
import math

from xpusense.common import metric_names as m
from xpusense.v1 import telemetry_pb2 as pb

from . import diagnoses as dg

KIND_NAMES = {pb.GAUGE: "gauge", pb.COUNTER: "counter", pb.HISTOGRAM: "histogram"}


def _iso(ns: int) -> str | None:
    if not ns:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat(timespec="milliseconds")


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


class PagingError(Exception):
    pass


def fetch_all(call, request: pb.ListNodesRequest, max_pages: int = 100_000) -> pb.ListNodesReply:
    """Every page of ListNodes (`call(request) -> reply`) as one reply: a node whose series went on
    over a page boundary (`continued`) is put back together. A collector without paging answers
    in one page; one that hands back a token it was given (no progress) is an error, not a loop."""
    merged = pb.ListNodesReply()
    req = pb.ListNodesRequest()
    req.CopyFrom(request)
    for _ in range(max_pages):
        reply = call(req)
        merged.time_unix_nano = merged.time_unix_nano or reply.time_unix_nano
        merged.counters.clear()
        merged.counters.update(reply.counters)   # the last page's are the newest
        for nv in reply.nodes:
            last = merged.nodes[-1] if merged.nodes else None
            if nv.continued and last is not None and last.node_id == nv.node_id:
                last.series.extend(nv.series)
            else:
                merged.nodes.append(nv)
        if not reply.next_page_token:
            return merged
        if reply.next_page_token == req.page_token:
            raise PagingError(f"the collector gave page token {req.page_token[:64]!r} again: no progress")
        req.page_token = reply.next_page_token
    raise PagingError(f"more than {max_pages} pages")


def node_to_dict(nv: pb.NodeView, now_ns: int, stale_s: float) -> dict:
    age_s = (now_ns - nv.last_seen_unix_nano) / 1e9 if nv.last_seen_unix_nano else None
    series = []
    for s in sorted(nv.series, key=lambda s: (s.name, sorted(s.labels.items()))):
        d = {"name": s.name, "labels": dict(s.labels), "unit": s.unit, "kind": KIND_NAMES.get(s.kind, "gauge"),
             "value": _num(s.value), "time": _iso(s.time_unix_nano)}
        if s.kind == pb.COUNTER:
            d["rate"] = _num(s.rate)
        if s.kind == pb.HISTOGRAM:
            d["histogram"] = {"bounds": list(s.histogram.bounds), "counts": list(s.histogram.counts),
                              "sum": s.histogram.sum, "count": s.histogram.count}
        series.append(d)
    inv = nv.inventory
    return {
        "node_id": nv.node_id,
        "boot_id": nv.boot_id or None,   # None: not shown to this caller (docs/security.md)
        "boot_tag": nv.boot_tag,
        "connected": nv.connected,
        "stale": age_s is None or age_s > stale_s,
        "last_seen": _iso(nv.last_seen_unix_nano),
        "last_seen_age_s": None if age_s is None else round(age_s, 3),
        "peer": nv.peer,
        "stored_up_to": nv.stored_up_to,
        "batches_stored": nv.batches_stored,
        "batches_duplicate": nv.batches_duplicate,
        "inventory": {
            "hostname": inv.hostname,
            "labels": dict(inv.labels),
            "resources": [{"type": r.type, "vendor": r.vendor, "model": r.model, "id": r.id,
                           "attributes": dict(r.attributes),
                           "interconnects": [{"type": i.type, "bandwidth": i.bandwidth} for i in r.interconnects]}
                          for r in inv.resources],
        },
        "series": series,
        "series_total": max(nv.series_total, len(series)),
        "events_omitted": nv.events_omitted,
        "events": [{"id": e.id, "type": e.type, "severity": e.severity, "device": e.device, "message": e.message,
                    "attributes": dict(e.attributes), "time": _iso(e.time_unix_nano)} for e in nv.events],
        "diagnoses": [diagnosis_to_dict(e, now_ns) for e in nv.diagnoses],
    }


PROCESS_ATTRIBUTES = ("process.pid", "process.executable.name", "k8s.pod.name", "k8s.namespace.name", "cgroup")


def diagnosis_to_dict(e: pb.Event, now_ns: int) -> dict:
    """An open diagnosis (its open event) as `nodes --format json` shows it."""
    a = e.attributes
    since = dg.opened_ns(e)
    return {"id": dg.diagnosis_id(e), "device": e.device, "rule": a.get(dg.RULE, ""), "severity": e.severity,
            "symptom": a.get(dg.SYMPTOM, ""), "cause": a.get(dg.CAUSE, ""), "remedy": a.get(dg.REMEDY, ""),
            "message": e.message, "since": _iso(since),
            "open_for_s": round(max(0, now_ns - since) / 1e9, 3) if since else None,
            "evidence": dg.evidence(e),
            "concerns": {k: a[k] for k in PROCESS_ATTRIBUTES if a.get(k)},
            "event_id": e.id}


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    return f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def _find(node: dict, name: str, **labels) -> dict | None:
    for s in node["series"]:
        if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items()):
            return s
    return None


def _fmt(v, spec: str = ".0f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if v is None else f"{v * scale:{spec}}{suffix}"


def _bytes_rate(v) -> str:
    if v is None:
        return "-"
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(v) < 1000:
            return f"{v:.0f}{unit}"
        v /= 1000
    return f"{v:.0f}TB/s"


def host_line(node: dict) -> dict:
    idle = _find(node, m.CPU_UTILIZATION, state="idle")
    mem = _find(node, m.MEMORY_UTILIZATION)
    rx = sum(s.get("rate") or 0 for s in node["series"]
             if s["name"] == m.NETWORK_IO and s["labels"].get("direction") == "receive"
             and s["labels"].get("device") != "lo")
    tx = sum(s.get("rate") or 0 for s in node["series"]
             if s["name"] == m.NETWORK_IO and s["labels"].get("direction") == "transmit"
             and s["labels"].get("device") != "lo")
    return {
        "cpu": _fmt(None if idle is None or idle["value"] is None else 1 - idle["value"], ".0f", 100, "%"),
        "mem": _fmt(mem and mem["value"], ".0f", 100, "%"),
        "rx": _bytes_rate(rx), "tx": _bytes_rate(tx),
    }


def accelerators(node: dict) -> list[dict]:
    """One row per accelerator, from the inventory and the series labelled with its device."""
    devs: dict[str, dict] = {}
    for r in node["inventory"]["resources"]:
        if r["type"] in ("GPU", "NPU"):
            devs[r["id"]] = {"device": r["id"], "vendor": r["vendor"], "model": r["model"]}
    for s in node["series"]:
        if s["name"].startswith(m.ACCELERATOR_PREFIXES) and "device" in s["labels"]:
            d = devs.setdefault(s["labels"]["device"], {"device": s["labels"]["device"],
                                                       "vendor": s["labels"].get("vendor", ""), "model": ""})
            if "pid" in s["labels"] or "mig_instance" in s["labels"]:
                continue  # per-process and per-MIG-instance series are not the device's own
            sensor = s["labels"].get("sensor")
            d.setdefault("series", {})[s["name"] + (f"/{sensor}" if sensor else "")] = s["value"]
    rows = []
    for d in devs.values():
        v = d.get("series", {})
        rows.append({
            "device": d["device"], "vendor": d["vendor"], "model": d["model"],
            "util": _fmt(v.get(m.GPU_UTILIZATION), ".0f", 100, "%"),
            "hbm_bw": _fmt(v.get(m.HBM_BANDWIDTH_UTILIZATION), ".0f", 100, "%"),
            "hbm": _fmt(v.get(m.GPU_MEMORY_UTILIZATION), ".0f", 100, "%"),
            "power": _fmt(v.get(m.POWER), ".0f", 1, "W"),
            "temp": _fmt(v.get(f"{m.TEMPERATURE}/chip"), ".0f", 1, "C"),
        })
    return rows


def render_table(nodes: list[dict], width: int = 120) -> str:
    lines = [f"{'NODE':<22} {'STATE':<6} {'SEEN':>5} {'CPU':>5} {'MEM':>5} {'NET RX':>9} {'NET TX':>9} {'ACCEL':>5}"]
    for n in nodes:
        state = "down" if not n["connected"] else ("stale" if n["stale"] else "up")
        age = "-" if n["last_seen_age_s"] is None else f"{n['last_seen_age_s']:.0f}s"
        h = host_line(n)
        accs = accelerators(n)
        lines.append(f"{n['node_id'][:22]:<22} {state:<6} {age:>5} {h['cpu']:>5} {h['mem']:>5} "
                     f"{h['rx']:>9} {h['tx']:>9} {len(accs):>5}")
        if accs:
            lines.append(f"  {'DEVICE':<8} {'MODEL':<16} {'UTIL':>5} {'HBM':>5} {'HBM-BW':>6} {'POWER':>6} {'TEMP':>5}")
        for a in accs:
            lines.append(f"  {a['device'][:8]:<8} {a['model'][:16]:<16} {a['util']:>5} {a['hbm']:>5} "
                         f"{a['hbm_bw']:>6} {a['power']:>6} {a['temp']:>5}")
        for d in n.get("diagnoses", ()):
            since = (d["since"] or "")[11:19]   # HH:MM:SS (UTC)
            age = _age(d["open_for_s"])
            lines.append(f"  ? diagnosis {d['device'] or 'node':<8} {d['rule']:<22} since {since} ({age}): "
                         f"{d['cause'] or d['message']}")
        recent = [e for e in n["events"] if e["type"] != "source_unavailable"][:3]
        for e in recent:
            lines.append(f"  ! {e['time'] or ''} {e['severity']} {e['type']} {e['device']} {e['message']}")
    if not nodes:
        lines.append("(no nodes have reported yet)")
    return "\n".join(line[:width] for line in lines)
