"""The collector's record of what it has stored: per node and agent boot, every sequence number.

One JSON line per stored batch, written and flushed before the batch is acknowledged, so a
collector killed at any point and restarted knows the highest sequence number it stored for each
agent boot, tells the agent in Welcome, and drops a resent batch instead of storing it twice.
flush() reaches the kernel, which survives a killed process; it is not fsync'ed per batch, so a
power loss can forget the last batches (they are then resent and stored, never lost).
On start the file is compacted to one line per (node, boot) holding the highest mark.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("xpusense.collector.marks")


class MarksJournal:
    def __init__(self, path: str, keep_boots_per_node: int = 8):
        self.path = path
        self.keep = keep_boots_per_node
        self.marks: dict[tuple[str, str], int] = {}
        self._f = None

    def open(self) -> dict[tuple[str, str], int]:
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        bad = 0
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                        key = (r["node"], r["boot"])
                        self.marks[key] = max(self.marks.get(key, 0), int(r["seq"]))
                    except (ValueError, KeyError, TypeError):
                        bad += 1  # a torn last line after a crash: the batch was not acknowledged
        if bad:
            log.warning("%s: skipped %d unreadable lines (a write cut short by a crash)", self.path, bad)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for (node, boot), seq in self.marks.items():
                f.write(json.dumps({"node": node, "boot": boot, "seq": seq, "compacted": True}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        return dict(self.marks)

    def record(self, node: str, boot: str, seq: int, samples: int) -> None:
        self._f.write(f'{{"node": {json.dumps(node)}, "boot": {json.dumps(boot)}, "seq": {seq}, "samples": {samples}}}\n')
        self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
