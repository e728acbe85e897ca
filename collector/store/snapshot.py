"""Snapshot files of the fleet state: what a restart loads before it replays only the log after them.

`data_dir/snapshots/snapshot-SSSSSSSS-OOOOOOOOOOOO.snap` covers the store up to segment S, byte O:
every record before that position is in it (image.py says how a node's marks make that exact).
The file is SNAPSHOT_MAGIC, then frames in the store's own format (frames.py: magic, length,
crc32, msgpack payload):

    ["h", VERSION, segment, offset, created_unix_ns]   first
    ["f", fleet]                                       known marks, counters (image.fleet)
    ["n", [node, ...]]                                 nodes, a chunk at a time (image.node)
    ["e", nodes, frames]                               last: how many nodes and frames came before it

Written to a temporary file in the same directory, fsync'ed, renamed into place and the directory
fsync'ed, so a snapshot is there whole or not at all. A snapshot that does not read back whole
(a frame whose checksum fails, a cut file, no end record, a count that differs) is damaged: at
start it is counted, logged and ignored, and the next older one is tried, else the whole log is
replayed (the log is kept until a good snapshot covers it: writer.py retention). Temporary files
left by a crash are removed at start (counted the same way).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import time
from collections.abc import Iterator

import msgpack

from .frames import HEADER_BYTES, frame, frame_at
from .image import VERSION, restore_fleet, restore_node

log = logging.getLogger("xpusense.collector.store")

SNAPSHOT_MAGIC = b"XPSSNP\x00\x01"
NAME = re.compile(r"^snapshot-(\d{8,})-(\d{12,})\.snap$")
TMP_PREFIX = ".tmp-"


class Damaged(Exception):
    pass


def snapshot_name(pos: tuple[int, int]) -> str:
    return f"snapshot-{pos[0]:08d}-{pos[1]:012d}.snap"


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotFile:
    """One snapshot being written (in a worker thread, never on the event loop)."""

    def __init__(self, directory: str, pos: tuple[int, int], fsync: bool = True):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.dir, self.pos, self.fsync = directory, pos, fsync
        self.path = os.path.join(directory, snapshot_name(pos))
        self.tmp = os.path.join(directory, f"{TMP_PREFIX}{snapshot_name(pos)}.{os.getpid()}")
        self.f = open(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb")
        self.frames = self.nodes = self.bytes = 0
        self.f.write(SNAPSHOT_MAGIC)
        self.add(["h", VERSION, pos[0], pos[1], time.time_ns()])

    def add(self, record: list) -> None:
        data = frame(record)
        self.f.write(data)
        self.frames += 1
        self.bytes += len(data)
        if record[0] == "n":
            self.nodes += len(record[1])

    def finish(self) -> str:
        self.add(["e", self.nodes, self.frames])
        self.f.flush()
        if self.fsync:
            os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        if self.fsync:
            _fsync_dir(self.dir)
        return self.path

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


def listed(directory: str) -> list[tuple[tuple[int, int], str]]:
    """(position, path) of every snapshot file, newest (highest position) first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = [((int(m.group(1)), int(m.group(2))), os.path.join(directory, name))
           for name in names if (m := NAME.match(name))]
    return sorted(out, reverse=True)


def records(path: str) -> Iterator[list]:
    """The records of a snapshot file in order; Damaged as soon as it does not read as a whole one."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(SNAPSHOT_MAGIC) + HEADER_BYTES:
            raise Damaged(f"{size} bytes, too short for a snapshot")
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as buf:
            if buf[:len(SNAPSHOT_MAGIC)] != SNAPSHOT_MAGIC:
                raise Damaged("not a snapshot (magic)")
            pos, frames, nodes = len(SNAPSHOT_MAGIC), 0, 0
            while pos < size:
                payload = frame_at(buf, pos, size)
                if payload is None:
                    raise Damaged(f"bytes from {pos} on are not a whole frame with a good checksum")
                pos += HEADER_BYTES + len(payload)
                try:
                    rec = msgpack.unpackb(payload, raw=False)
                except (ValueError, msgpack.UnpackException) as e:
                    raise Damaged(f"a frame at {pos} is not msgpack ({e})") from None
                if not isinstance(rec, list) or not rec:
                    raise Damaged(f"a frame at {pos} is not a snapshot record")
                if rec[0] == "e":
                    if rec[1:] != [nodes, frames] or pos != size:
                        raise Damaged(f"the end record says {rec[1:]} nodes and frames, read {[nodes, frames]}"
                                      f"{'' if pos == size else f', and {size - pos} bytes follow it'}")
                    return
                if frames == 0 and (rec[0] != "h" or rec[1] != VERSION):
                    raise Damaged(f"first record {rec[:2]!r}, not a version {VERSION} header")
                frames += 1
                nodes += len(rec[1]) if rec[0] == "n" else 0
                yield rec
    raise Damaged("cut short: no end record")


def load(path: str, state) -> tuple[int, int]:
    """Load one snapshot into an empty `state`; its position. Damaged (the state then holds part of
    it: see reset()) when it does not read back whole."""
    pos = (0, 0)
    for rec in records(path):
        try:
            if rec[0] == "h":
                pos = (int(rec[2]), int(rec[3]))
            elif rec[0] == "f":
                restore_fleet(state, rec[1])
            elif rec[0] == "n":
                for data in rec[1]:
                    restore_node(state, data)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise Damaged(f"a {rec[0]!r} record does not fit the fleet state ({e!r:.200})") from None
    return pos


def reset(state) -> None:
    """Forget what a damaged snapshot put into the state before it was found damaged."""
    state.nodes.clear()
    state.known_marks.clear()
    state.counters.clear()
    state.diagnoses.opened.clear()
    state.series_total = state.history_slots = 0


class Snapshots:
    """data_dir/snapshots/: what start loads, what is kept, what retention may rely on."""

    def __init__(self, data_dir: str, keep: int = 2):
        self.dir = os.path.join(data_dir, "snapshots")
        self.keep = max(1, keep)
        self.figures: dict[str, float] = {"snapshot_loaded": 0, "snapshot_damaged": 0, "snapshot_load_ms": 0,
                                          "snapshot_nodes": 0}

    def load_newest(self, state) -> tuple[int, int] | None:
        """Remove temporary files left by a crash; load the newest snapshot that reads back whole
        (older ones are tried in turn); its position, or None (then the whole log is replayed)."""
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
        for _pos, path in listed(self.dir):
            try:
                pos = load(path, state)
            except (Damaged, OSError) as e:
                reset(state)
                self.figures["snapshot_damaged"] += 1
                log.warning("store snapshot %s is damaged (%s): ignored, %s; trying an older one, else replaying "
                            "the whole log (counted: snapshot_damaged)", path, e, self._set_aside(path))
                continue
            self.figures.update(snapshot_loaded=1, snapshot_nodes=len(state.nodes),
                                snapshot_load_ms=round((time.monotonic() - t0) * 1000))
            log.info("store snapshot %s loaded: %d nodes in %.2f s; replaying the log after segment %d byte %d",
                     path, len(state.nodes), time.monotonic() - t0, *pos)
            return pos
        return None

    def _set_aside(self, path: str) -> str:
        """A damaged snapshot goes to data_dir/damaged/ (not tried again, not counted as kept)."""
        dest = os.path.join(os.path.dirname(self.dir), "damaged", os.path.basename(path))
        try:
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            os.replace(path, dest)
        except OSError as e:
            return f"NOT moved aside ({e.strerror})"
        return f"moved to {dest}"

    def prune(self) -> tuple[int, int] | None:
        """Keep the newest `keep` snapshots; the oldest kept one's position (what the log must
        still hold from: a damaged newest one falls back to it)."""
        have = listed(self.dir)
        for _, path in have[self.keep:]:
            try:
                os.unlink(path)
            except OSError as e:
                log.warning("store snapshot %s: cannot remove (%s)", path, e.strerror)
        kept = have[:self.keep]
        return kept[-1][0] if kept else None
