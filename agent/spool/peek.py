"""A read-only look into a spool directory (no lock taken, nothing changed): which batches an
agent left there unacknowledged. For tests and for a person inspecting a node."""

from __future__ import annotations

import os

from . import ack_file, records


def unacked(directory: str) -> list[tuple[str, int]]:
    """(boot, seq) of the whole records in the spool that are above their boot's acknowledged mark."""
    try:
        acked, _ = ack_file.load(directory)
    except (OSError, ValueError):
        acked = {}
    found: list[tuple[str, int]] = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".seg"):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        except FileNotFoundError:   # acknowledged and deleted meanwhile
            continue
        try:
            for r in records.scan(fd):
                if isinstance(r, records.Good):
                    found.append((r.boot, r.seq))
                elif isinstance(r, records.Acks):
                    acked.update((b, max(s, acked.get(b, 0))) for b, s in r.marks.items())
        finally:
            os.close(fd)
    return [(b, s) for b, s in found if s > acked.get(b, 0)]
