"""Files on disk kept byte for byte (tests/fixtures/ondisk/): a spool, a store's segment, a full
snapshot and a diff on it, each with damaged bytes, and what they replay to (spool.json,
store.json). Every release must read them the same way and write every record in them the same."""

from __future__ import annotations

import json
import math
import os
import shutil

import msgpack

from xpusense.agent.spool import Spool, records
from xpusense.collector.state import FleetState
from xpusense.collector.store import Store
from xpusense.collector.store.segment_file import MAX_RECORD_BYTES, RECORD_MAGIC, Segment, frame, parse
from xpusense.collector.store.snapshot_file import Reader
from xpusense.common import framing

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ondisk")
T0 = 1_700_000_000 * 10**9


def expected(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def digest(st: FleetState) -> dict:
    """The state as plain data: marks, diagnoses, and every series' latest value and points."""
    out: dict = {"known": sorted([*k, v] for k, v in st.known_marks.items()),
                 "opened": dict(sorted(st.diagnoses.opened.items())),
                 "counts": [st.series_total, st.history_slots], "nodes": {}}
    for nid in sorted(st.nodes):
        n = st.nodes[nid]
        series = {}
        for s in n.series.values():
            v = s.value
            points = st.history(nid, s.name, dict(s.labels)).points
            series[s.name + json.dumps(dict(sorted(s.labels.items())))] = {
                "value": None if isinstance(v, float) and math.isnan(v) else v, "time": s.time_ns,
                "points": [[p.time_unix_nano, p.value] for p in points]}
        out["nodes"][nid] = {"boot": n.boot_id, "marks": [list(m) for m in n.stored_up_to.items()],
                             "mark_at": dict(n.mark_at), "diagnoses": list(n.diagnoses),
                             "diagnoses_boot": n.diagnoses_boot, "hostname": n.inventory.hostname,
                             "events": [e.message for e in n.events], "stored": n.batches_stored,
                             "duplicate": n.batches_duplicate, "series": dict(sorted(series.items()))}
    return out


def test_a_store_with_snapshots_replays_to_the_same_state(tmp_path):
    data = tmp_path / "store"
    shutil.copytree(os.path.join(FIXTURES, "store"), data)
    st = FleetState(history_s=900.0, clock=lambda: T0 + 10**12)
    figures = Store(str(data)).open(st)
    want = expected("store.json")
    assert {k: figures[k] for k in want["figures"]} == want["figures"]
    assert json.loads(json.dumps(digest(st))) == want["state"]


def test_every_store_record_and_snapshot_frame_is_written_the_same_today():
    with Segment(os.path.join(FIXTURES, "store", "00000001.log")) as seg:
        spans = list(seg.spans())
        assert [(s.start, s.end) for s in spans if s.payload is None] == [(5357, 5526)]
        assert len(spans) > 20
        for s in spans:
            if s.payload is not None:
                assert frame(parse(s.payload)) == seg.buf[s.start:s.end]
    snaps = os.path.join(FIXTURES, "store", "snapshots")
    for name in sorted(os.listdir(snaps)):
        with Reader(os.path.join(snaps, name)) as r:
            kinds = [rec[0] for rec, _blob in r.records()]
        assert r.version == 3 and kinds[0] == "f" and "n" in kinds
        raw = open(os.path.join(snaps, name), "rb").read()
        frames = list(framing.scan(raw, 8, len(raw), RECORD_MAGIC, MAX_RECORD_BYTES))
        assert len(frames) == len(kinds) + 2 and all(f.payload is not None for f in frames)   # + header, end
        assert b"".join(framing.encode(RECORD_MAGIC, f.payload) for f in frames) == raw[8:]


def test_a_spool_with_damage_gives_back_the_same_batches(tmp_path):
    data = tmp_path / "spool"
    shutil.copytree(os.path.join(FIXTURES, "spool"), data)
    sp = Spool(str(data))
    found = sp.open()
    want = expected("spool.json")
    assert [[k[0], k[1], sp.read(loc).hex()] for k, loc in found] == want["found"]
    assert (sp.damaged_records, sp.damaged_bytes) == (want["damaged_records"], want["damaged_bytes"])
    sp.close()


def test_every_spool_record_is_written_the_same_today():
    good = 0
    for name in ("00000001.seg", "00000002.seg"):
        path = os.path.join(FIXTURES, "spool", name)
        raw = open(path, "rb").read()
        fd = os.open(path, os.O_RDONLY)
        try:
            for r in records.scan(fd):
                if isinstance(r, records.Good):
                    good += 1
                    assert records.encode(r.boot, r.seq, r.samples, r.batch) == raw[r.offset:r.offset + r.length]
                    assert msgpack.unpackb(raw[r.offset + 12:r.offset + r.length])[1] == r.seq
        finally:
            os.close(fd)
    assert good == 11
