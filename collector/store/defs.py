"""The compact encoding (common/compact.py) at rest: SeriesTable records ("d") read back, the
tables that carry a whole dictionary (a new segment's checkpoint), and a stored compact batch as
the samples it stands for, for the exporters' readers (series_dictionary.expand)."""

from __future__ import annotations

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from ..series_dictionary import SeriesDictionary
from .segment_file import MAX_DEFS_BYTES, frame

# Samples of one stored compact batch, at most (decode_columns' bound; ingest allowed far fewer).
MAX_STORED_SAMPLES = 1_000_000


def read_table(node_id: str, table: bytes) -> tuple[str, list[pb.Sample]]:
    """A "d" record's SeriesTable: its boot and definitions. ValueError (compact.CompactError,
    protobuf's DecodeError) where it does not read."""
    t = pb.SeriesTable.FromString(table)
    if not t.boot_id:
        raise ValueError(f"a series table of node {node_id!r} without a boot id")
    return t.boot_id, compact.decode_defs(t.defs, MAX_DEFS_BYTES)


def expanded(batch: pb.Batch, dictionary: SeriesDictionary) -> pb.Batch:
    """A stored compact batch as the Sample encoding would have carried it (a batch without columns
    as it is); series_dictionary.MissingDefinition or compact.CompactError where it cannot be."""
    if not batch.columns:
        return batch
    columns = compact.decode_columns(batch.columns, MAX_STORED_SAMPLES)
    dictionary.check(batch.node_id, batch.boot_id, columns.refs)
    return compact.expand(batch, columns, dictionary.definitions(batch.node_id, batch.boot_id))


class Tables:
    """Every (node, boot)'s definitions as one "d" record each (what a new segment begins with, so
    older segments can go), encoded again only where a boot's definitions changed since. `take`
    runs on the event loop, `records` after it in the store's one I/O thread, never two at once."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[int, bytes]] = {}   # (node, boot) -> (definitions, record)

    def take(self, dictionary: SeriesDictionary) -> list[tuple[str, str, int, list[pb.Sample] | None]]:
        """(node, boot, how many definitions, the definitions or None where the record held is of
        as many: a definition is never changed once held)."""
        out = []
        for (node, boot), defs in dictionary.boots.items():
            if defs:
                was = self._held.get((node, boot))
                out.append((node, boot, len(defs), None if was is not None and was[0] == len(defs)
                            else list(defs.values())))
        return out

    def records(self, taken: list[tuple[str, str, int, list[pb.Sample] | None]]) -> bytes:
        """The framed "d" records of what `take` took; only those records are held after."""
        held: dict[tuple[str, str], tuple[int, bytes]] = {}
        for node, boot, count, defs in taken:
            was = self._held.get((node, boot)) if defs is None else None
            if was is None:
                if defs is None:
                    continue   # never: take and records alternate
                table = pb.SeriesTable(boot_id=boot, defs=compact.encode_defs(defs)).SerializeToString()
                was = (count, frame(["d", node, table]))
            held[(node, boot)] = was
        self._held = held
        return b"".join(r for _, r in held.values())
