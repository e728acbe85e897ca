"""What a node id and an agent boot id may be: the one rule the agent's config and the collector's
ingest both apply (ids end up in logs, file names, labels and KV keys)."""

from __future__ import annotations

MAX_ID_LEN = 253   # a node id is usually a host name (at most 253 characters)


def bad_id(what: str, v: str) -> str | None:
    """Why a node or boot id is unusable, or None."""
    if not 0 < len(v) <= MAX_ID_LEN:
        return f"{what} must have 1 to {MAX_ID_LEN} characters, not {len(v)}"
    if not v.isprintable() or any(c.isspace() for c in v):
        return f"{what} {v[:64]!r} has spaces or control characters"
    return None
