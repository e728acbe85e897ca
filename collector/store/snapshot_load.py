"""Snapshots of the fleet state at start: which to load, loading them, damage, which to keep.

A restart loads the newest full snapshot that reads back whole, then the newest of its diffs that
does, and replays only the log after the one it ended with. A damaged file is counted, logged,
moved to `data_dir/damaged/` and an older one tried; with none the whole log is replayed (the log
is kept until a good snapshot covers it: `prune`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator

from google.protobuf.message import DecodeError

from .fleet_image import restore, restore_dictionary, restore_fleet, restore_node_v1
from .snapshot_file import TMP_PREFIX, Damaged, Entry, Pos, Reader, SnapshotFile, entries, snapshot_name

log = logging.getLogger("xpusense.collector.store")

__all__ = ["TMP_PREFIX", "Damaged", "SnapshotFile", "Snapshots", "listed", "records", "snapshot_name"]

SHAPE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, DecodeError)
DIFFS_KEPT = 2   # of the newest full snapshot (one to fall back on); one of each older full snapshot kept


def listed(directory: str) -> list[tuple[Pos, str]]:
    """(position, path) of every snapshot file, full and diffs, newest first."""
    return [(e.pos, e.path) for e in entries(directory)]


def records(path: str) -> Iterator[list]:
    """The records of a snapshot file after its header (tests, inspection); Damaged as soon as it
    does not read as a whole one."""
    with Reader(path) as r:
        for rec, _blob in r.records():
            yield rec


def _apply(reader: Reader, state, recs) -> None:
    for rec, blob in recs:
        try:
            if rec[0] == "f":
                restore_fleet(state, rec[1])
            elif rec[0] == "n" and reader.version == 1:
                for data in rec[1]:
                    restore_node_v1(state, data)
            elif rec[0] == "n":
                at = 0
                for entry in rec[1]:
                    at = restore(state, entry, blob, at)
                if at != len(blob):
                    raise ValueError(f"{len(blob) - at} bytes of history no node says are its")
            elif rec[0] == "d":
                restore_dictionary(state, rec[1])
        except SHAPE_ERRORS as e:
            raise Damaged(f"a {rec[0]!r} record does not fit the fleet state ({e!r:.200})") from None
        finally:
            del blob


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        log.warning("store snapshot %s: cannot remove (%s)", path, e.strerror)


def reset(state) -> None:
    """Forget what a damaged snapshot put into the state before it was found damaged."""
    state.nodes.clear()
    state.known_marks.clear()
    state.counters.clear()
    state.diagnoses.opened.clear()
    state.dictionary.boots.clear()
    state.series_total = state.history_slots = state.frame_points = state.frame_rows = 0


class Snapshots:
    """data_dir/snapshots/: what start loads, what is kept, what retention may rely on."""

    def __init__(self, data_dir: str, keep: int = 2):
        self.dir = os.path.join(data_dir, "snapshots")
        self.keep = max(1, keep)
        self.figures: dict[str, float] = {"snapshot_loaded": 0, "snapshot_damaged": 0, "snapshot_load_ms": 0,
                                          "snapshot_nodes": 0, "snapshot_diff_loaded": 0}

    def load_newest(self, state) -> Pos | None:
        """Remove temporary files left by a crash; load the newest full snapshot that reads back whole
        (older ones are tried in turn) and the newest good diff on it; the position loaded up to, or
        None (then the whole log is replayed). The cyclic collector is off meanwhile: hundreds of
        thousands of objects are made and none is garbage."""
        t0 = time.monotonic()
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return None
        for name in names:
            if name.startswith(TMP_PREFIX):
                self.figures["snapshot_damaged"] += 1
                log.warning("store snapshot %s: a partial snapshot (the collector stopped while writing it): removed",
                            os.path.join(self.dir, name))
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
        was = gc.isenabled()
        gc.disable()
        try:
            return self._load(state, t0)
        finally:
            if was:
                gc.enable()

    def _load(self, state, t0: float) -> Pos | None:
        skip: set[str] = set()   # found damaged (moved aside, or tried to be)
        while True:
            found = [e for e in entries(self.dir) if e.path not in skip]
            for base in (e for e in found if e.base is None):
                try:
                    with Reader(base.path) as r:
                        if r.pos != base.pos or r.base is not None:
                            raise Damaged(f"its header says position {r.pos}, base {r.base}")
                        _apply(r, state, r.records())
                        base_id = r.id
                except (Damaged, OSError) as e:
                    reset(state)
                    self._damaged(base.path, e, skip)
                    continue
                t1 = time.monotonic()
                pos, diff = self._diff(state, base, base_id, found, skip)
                if diff == "reload":
                    reset(state)
                    break
                for n in state.nodes.values():
                    for w in state.watchers:
                        w(n, None)
                loaded = os.path.basename(base.path) + (f"+{os.path.basename(diff)}" if diff else "")
                self.figures.update(snapshot_loaded=1, snapshot_nodes=len(state.nodes), snapshot_diff_loaded=int(bool(diff)),
                                    snapshot_load_ms=round((time.monotonic() - t0) * 1000))
                log.info("store snapshot %s loaded: %d nodes in %.2f s (full %.2f s, diff %.2f s); replaying the log "
                         "after segment %d byte %d", loaded, len(state.nodes), time.monotonic() - t0, t1 - t0,
                         time.monotonic() - t1, *pos)
                return pos
            else:
                return None

    def _diff(self, state, base: Entry, base_id: int, found: list[Entry], skip: set[str]) -> tuple[Pos, str]:
        """Apply the newest good diff on `base`: (the position loaded up to, its path or ""), or
        (_, "reload") when one failed part-way (the base must be loaded again without it)."""
        for d in (e for e in found if e.base == base.pos):
            applying = stale = False
            try:
                with Reader(d.path) as r:
                    if r.base is None or r.pos != d.pos:
                        raise Damaged(f"its header says position {r.pos}, base {r.base}")
                    stale = r.base != (base.pos, base_id)
                    if not stale:
                        recs = list(r.records())   # every checksum checked before anything is applied
                        applying = True
                        try:
                            _apply(r, state, recs)
                        finally:
                            del recs
            except (Damaged, OSError) as e:
                self._damaged(d.path, e, skip)
                if applying:
                    return base.pos, "reload"
                continue
            if stale:
                skip.add(d.path)
                log.info("store snapshot %s: written on an earlier full snapshot at the same position: not applied, "
                         "removed", d.path)
                _unlink(d.path)
                continue
            return d.pos, d.path
        return base.pos, ""

    def _damaged(self, path: str, e: Exception, skip: set[str]) -> None:
        skip.add(path)
        self.figures["snapshot_damaged"] += 1
        log.warning("store snapshot %s is damaged (%s): ignored, %s; trying an older one, else replaying the log "
                    "(counted: snapshot_damaged)", path, e, self._set_aside(path))

    def _set_aside(self, path: str) -> str:
        """A damaged snapshot goes to data_dir/damaged/ (not tried again, not counted as kept)."""
        dest = os.path.join(os.path.dirname(self.dir), "damaged", os.path.basename(path))
        try:
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            os.replace(path, dest)
        except OSError as e:
            return f"NOT moved aside ({e.strerror})"
        return f"moved to {dest}"

    def prune(self) -> Pos | None:
        """Keep the newest `keep` full snapshots, the newest DIFFS_KEPT diffs of the newest one and
        the newest diff of each older one; the oldest full snapshot's position (what the log must
        still hold from: a damaged newest one falls back to an older one and the log after it)."""
        have = entries(self.dir)
        full = [e.pos for e in have if e.base is None][:self.keep]
        room = {pos: DIFFS_KEPT if i == 0 else 1 for i, pos in enumerate(full)}
        for e in have:
            if e.base is None and e.pos in room:
                continue
            if e.base is not None and room.get(e.base, 0) > 0:
                room[e.base] -= 1
                continue
            _unlink(e.path)
        return full[-1] if full else None
