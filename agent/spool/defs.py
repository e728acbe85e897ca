"""Each boot's series definitions for the compact encoding (name, unit, kind, labels of each
series_ref; common/compact.py), append-only since a boot never reuses a number; with a spool, kept
beside it in one file of checksummed frames per boot (`series-BOOT.xsd`), written before the batches
that use them are spooled and fsynced before the spool fsyncs any, read back at start for the old
boots' spooled batches and deleted once a boot has no batch left (layout: docs/design.md, agent
spool)."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable

from xpusense.common import compact, framing
from xpusense.v1 import telemetry_pb2 as pb

from .store import Spool

log = logging.getLogger("xpusense.agent.stream")

MAGIC = b"XSD1"
MAX_FRAME_BYTES = 64 * 2**20      # one frame's payload (and its definitions inflated)
_FILE = re.compile(r"^series-(.+)\.xsd$")


def _path(directory: str, boot: str) -> str:
    return os.path.join(directory, f"series-{re.sub(r'[^A-Za-z0-9._-]', '_', boot)}.xsd")


class SeriesDefs:
    """Definitions by boot and series_ref (`get`); `add` keeps a new one, `save` writes the ones not
    on disk yet. A frame is a SeriesTable (the stream's own message), its boot checked on reading.
    A damaged frame loses its definitions (counted `damaged`): a batch that needs one of them is set
    aside by the stream, never sent wrong. At most `max_per_boot` definitions a boot are read."""

    def __init__(self, directory: str | None, max_per_boot: int):
        self.dir = directory
        self.max_per_boot = max_per_boot
        self.boots: dict[str, dict[int, pb.Sample]] = {}
        self._unsaved: dict[str, list[pb.Sample]] = {}
        self.damaged = 0            # frames of a definitions file that did not check out
        self.write_failures = 0     # saves that failed (tried again with the next batch)
        self.bytes = 0              # of the definitions files
        self._error = ""
        self._unsynced: set[str] = set()   # files written since their last fsync
        self._sync_lock = threading.Lock()

    @classmethod
    def beside(cls, spool: Spool | None, max_per_boot: int) -> SeriesDefs:
        """Definitions kept with `spool` (in memory only without one), fsynced before it fsyncs."""
        defs = cls(spool.dir if spool is not None else None, max_per_boot)
        if spool is not None:
            spool.before_fsync = defs.sync
        return defs

    def __len__(self) -> int:
        return sum(len(d) for d in list(self.boots.values()))   # a copy: status() reads it unlocked

    def get(self, boot: str) -> dict[int, pb.Sample] | None:
        return self.boots.get(boot)

    def add(self, boot: str, definition: pb.Sample) -> None:
        self.boots.setdefault(boot, {})[definition.series_ref] = definition
        if self.dir is not None:
            self._unsaved.setdefault(boot, []).append(definition)

    def save(self) -> None:
        """Write the definitions added since the last save, one frame a boot (before the batches
        using them are spooled; `sync` makes them durable). A failure is logged once per change and
        tried again."""
        for boot in list(self._unsaved):
            assert self.dir is not None
            data = framing.encode(MAGIC, pb.SeriesTable(boot_id=boot, defs=compact.encode_defs(
                self._unsaved[boot])).SerializeToString())
            path = _path(self.dir, boot)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                with self._sync_lock:
                    self._unsynced.add(path)
            except OSError as e:
                self.write_failures += 1
                if self._error != str(e):
                    log.warning("spool %s: cannot write series definitions (%s): batches of boot %s spooled now "
                                "cannot be sent after a restart until a write succeeds", self.dir, e.strerror or e,
                                boot)
                self._error = str(e)
                return
            self._error = ""
            self.bytes += len(data)
            del self._unsaved[boot]

    def sync(self) -> None:
        """fsync the files written since their last fsync: the spool calls it before each fsync of its
        own, so a batch on disk has its definitions on disk. A file that fails is tried again next time."""
        with self._sync_lock:
            paths, self._unsynced = self._unsynced, set()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except FileNotFoundError:   # the boot's definitions were deleted meanwhile
                continue
            except OSError as e:
                with self._sync_lock:
                    self._unsynced.add(path)
                self.write_failures += 1
                if self._error != str(e):
                    log.warning("spool %s: cannot fsync series definitions (%s)", self.dir, e.strerror or e)
                self._error = str(e)

    def load(self, boots: set[str], current: str) -> int:
        """At start: the definitions of `boots` (those with batches in the spool) read back; the files
        of other boots deleted. The damaged frames found: returned."""
        if self.dir is None:
            return 0
        for name in sorted(os.listdir(self.dir)):
            m = _FILE.match(name)
            if not m:
                continue
            path = os.path.join(self.dir, name)
            boot = next((b for b in boots if _path(self.dir, b) == path), None)
            if boot is None or boot == current:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
            try:
                self._read(path, boot)
            except OSError as e:
                log.warning("spool %s: series definitions %s unreadable (%s): the batches of boot %s that need "
                            "them are set aside", self.dir, name, e.strerror or e, boot)
        return self.damaged

    def _read(self, path: str, boot: str) -> None:
        defs = self.boots.setdefault(boot, {})
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            self.bytes += size
            for span in framing.scan(framing.FileBytes(fd), 0, size, MAGIC, MAX_FRAME_BYTES):
                try:
                    if span.payload is None:
                        raise compact.CompactError(span.damage)
                    table = pb.SeriesTable.FromString(bytes(span.payload))
                    if table.boot_id != boot:
                        raise compact.CompactError(f"definitions of boot {table.boot_id!r}")
                    for d in compact.decode_defs(table.defs, MAX_FRAME_BYTES):
                        if len(defs) < self.max_per_boot and d.series_ref:
                            defs[d.series_ref] = d
                except Exception as e:   # CompactError, protobuf's DecodeError
                    self.damaged += 1
                    log.warning("spool %s: damaged series definitions at byte %d of %s (%s): the batches of boot "
                                "%s that need them are set aside", self.dir, span.start, os.path.basename(path), e,
                                boot)
        finally:
            os.close(fd)

    def retain(self, pending: Iterable[tuple[str, int]], current: str) -> None:
        """Forget the boots but `current` with no batch left in `pending` ((boot, seq) keys), their
        files deleted."""
        if not self.boots.keys() - {current}:
            return
        live = {k[0] for k in pending} | {current}
        for boot in [b for b in self.boots if b not in live]:
            del self.boots[boot]
            self._unsaved.pop(boot, None)
            if self.dir is not None:
                self._remove(_path(self.dir, boot))

    def _remove(self, path: str) -> None:
        try:
            size = os.stat(path).st_size
            os.unlink(path)
            self.bytes -= size
        except OSError:
            pass
