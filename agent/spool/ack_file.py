"""`acked.json` in a spool directory: the highest acknowledged seq per agent boot, and the batches
set aside at run time (boot, seq, the segment that holds them). Bounded read, atomic write."""

from __future__ import annotations

import json
import os

MAX_BYTES = 1 << 20


def load(directory: str) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
    """(marks, set aside); ({}, {}) when there is no file. ValueError/OSError when it is unreadable."""
    try:
        with open(os.path.join(directory, "acked.json"), "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}, {}
    if len(raw) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if "acked" not in doc:            # written before batches were set aside: marks only
        doc = {"acked": doc, "aside": []}
    try:
        return ({str(k): int(v) for k, v in doc["acked"].items()},
                {(str(b), int(s)): int(sid) for b, s, sid in doc["aside"]})
    except (TypeError, AttributeError) as e:
        raise ValueError(f"unexpected content ({e})") from None


def save(directory: str, marks: dict[str, int], aside: dict[tuple[str, int], int]) -> None:
    tmp = os.path.join(directory, "acked.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"acked": marks, "aside": sorted([b, s, sid] for (b, s), sid in aside.items())}, f)
    os.replace(tmp, os.path.join(directory, "acked.json"))
