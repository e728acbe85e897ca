"""Damaged spool records kept aside for inspection, in `<spool>/damaged/`, within a byte budget.

Each damaged span is copied to `damaged/<segment>@<offset>.bin` (the segment's name without its
suffix, the byte offset where the span starts). Over `max_bytes` the oldest files are removed
first, and a span larger than the whole budget is cut to it; both are counted and logged. A copy
that cannot be written (the disk is the problem, often) is logged and counted, never raised:
keeping evidence must not stop the agent.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("xpusense.agent.spool")

_CHUNK = 1 << 20


class Aside:
    def __init__(self, directory: str, max_bytes: int):
        self.dir = directory
        self.max_bytes = max_bytes
        self.kept = 0            # spans copied
        self.removed = 0         # older copies removed to stay within max_bytes
        self.cut = 0             # spans larger than max_bytes, kept in part
        self.failed = 0          # spans that could not be copied

    def _files(self) -> list[tuple[float, str, int]]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            p = os.path.join(self.dir, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((st.st_mtime, p, st.st_size))
        return sorted(out)

    def keep(self, fd: int, segment_name: str, offset: int, length: int) -> str | None:
        """Copy `length` bytes at `offset` of the open segment `fd`; the copy's path, or None."""
        if self.max_bytes <= 0:
            return None
        want = min(length, self.max_bytes)
        if want < length:
            self.cut += 1
            log.warning("damaged span of %d bytes at byte %d of %s: only its first %d bytes are kept "
                        "([spool] damaged_max_bytes)", length, offset, segment_name, want)
        path = os.path.join(self.dir, f"{segment_name.rsplit('.', 1)[0]}@{offset}.bin")
        try:
            os.makedirs(self.dir, exist_ok=True)
            files = self._files()
            used = sum(size for _, _, size in files)
            while files and used + want > self.max_bytes:
                _, old, size = files.pop(0)
                os.unlink(old)
                used -= size
                self.removed += 1
                log.warning("removed %s, the oldest damaged span kept, to stay within [spool] damaged_max_bytes "
                            "(%d bytes)", old, self.max_bytes)
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                done = 0
                while done < want:
                    data = os.pread(fd, min(_CHUNK, want - done), offset + done)
                    if not data:
                        break
                    os.write(out, data)
                    done += len(data)
            finally:
                os.close(out)
        except OSError as e:
            self.failed += 1
            log.warning("could not keep the damaged span at byte %d of %s aside in %s: %s", offset,
                        segment_name, self.dir, e.strerror or e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        self.kept += 1
        return path
