"""What the stream sends for a batch. Where the collector's Welcome chose a compact encoding: the
SeriesTable of the series the batch uses that this connection has not had defined yet, then the
batch as built (its columns written again in the older version a collector chose, or chained on
the block sent before them, common/compact_chain.py); where it chose none, a compact batch
expanded to the Sample messages it stands for (common/compact.py's `sample`, with the boot's
definitions). A spooled batch goes as its bytes where nothing is written again."""

from __future__ import annotations

from xpusense.common import compact
from xpusense.common.compact_chain import Chain, columns_span, varint, with_columns
from xpusense.v1 import telemetry_pb2 as pb

from .batch_build import MAX_ROWS
from .spool.defs import SeriesDefs
from .spool.records import batch_ids, without_ids

TABLE_DEFS = 5000     # definitions per SeriesTable message (the first of a stream may need many)


def encode_message(m: pb.AgentMessage | bytes) -> bytes:
    """The stream's request serializer: a message, or an AgentMessage already encoded."""
    return m if isinstance(m, bytes) else m.SerializeToString()


def batch_message(batch: bytes) -> bytes:
    """AgentMessage{batch} encoded around an encoded Batch (field 2, length-delimited): what
    AgentMessage(batch=Batch.FromString(batch)).SerializeToString() would be, without the decoding."""
    return b"\x12" + varint(len(batch)) + batch


class Unsendable(Exception):
    """A batch that cannot be sent as what it stands for; the message says why."""


class Connection:
    """Per connection: the highest series_ref of each boot whose definition the collector holds, sent
    on it or held already. Every connection starts from what its Welcome says the collector holds
    durably (`defined`: Welcome.series_defined_up_to of the Hello's boot, at most what this agent
    defined; 0 for other boots), so after a reconnect, to whichever collector, each definition a batch
    needs is there or goes before it on the same stream."""

    def __init__(self, defs: SeriesDefs, encoding: str, defined: dict[str, int] | None = None, ids: bytes = b""):
        self.defs = defs
        self.encoding = encoding   # the compact encoding the collector chose; "": Sample messages
        self.version = compact.VERSIONS.get(encoding, 0)   # of its columns
        self.compact = self.version > 0
        # The Hello's node and boot id as a Batch's first bytes: left out of a batch that starts with
        # them where the collector reads version 2 (it puts them back).
        self.ids = ids if self.version >= 2 else b""
        self.sent: dict[str, int] = dict(defined or {}) if self.compact else {}
        self.chain = Chain(MAX_ROWS) if encoding == compact.CHAINED else None

    @classmethod
    def welcomed(cls, defs: SeriesDefs, encoding: str, w: pb.Welcome, node_id: str, hello_boot: str,
                 top: int) -> Connection:
        """The connection a Welcome opens: compact where it chose an encoding the agent offered; the
        Hello's boot defined up to its series_defined_up_to, at most `top` (the agent's highest ref)."""
        chosen = w.batch_encoding if w.batch_encoding in compact.offered(encoding) else ""
        defined = {hello_boot: min(w.series_defined_up_to, top)} if w.boot_id == hello_boot else None
        return cls(defs, chosen, defined, batch_ids(node_id, hello_boot))

    def messages(self, boot: str, batch: pb.Batch | bytes, top: int) -> list[pb.AgentMessage | bytes]:
        """The messages for one batch of `boot` (a pb.Batch, or a Batch encoded). `top`: the highest
        series_ref it uses, known for a batch built in this run (whose definitions are all held); -1
        to read it from the batch, checking that every one of its references has a definition."""
        if top < 0 or not self.compact:
            b = batch if isinstance(batch, pb.Batch) else pb.Batch.FromString(batch)
            if not b.columns:
                return [self._whole(batch)]
            try:
                cols = compact.decode_columns(b.columns, MAX_ROWS)
            except compact.CompactError as e:
                raise Unsendable(f"its columns do not decode ({e})") from None
            defs = self.defs.get(boot) or {}
            if missing := next((r for r in cols.refs if r not in defs), None):
                raise Unsendable(f"no definition for series_ref {missing} of boot {boot} (its definitions are gone)")
            if not self.compact:
                return [pb.AgentMessage(batch=compact.expand(b, cols, defs))]
            top = max(cols.refs, default=0)
        # Once nothing can refuse it: a chained block moves the chain on, which the collector follows
        # only for the blocks it is sent.
        whole = self._whole(batch)
        out: list[pb.AgentMessage | bytes] = []
        sent = self.sent.get(boot, 0)
        if top > sent:
            defs = self.defs.get(boot) or {}
            todo = [defs[r] for r in range(sent + 1, top + 1) if r in defs]
            for i in range(0, len(todo), TABLE_DEFS):
                out.append(pb.AgentMessage(series=pb.SeriesTable(
                    boot_id=boot, defs=compact.encode_defs(todo[i:i + TABLE_DEFS]))))
            self.sent[boot] = top
        out.append(whole)
        return out

    def _whole(self, batch: pb.Batch | bytes) -> pb.AgentMessage | bytes:
        """The AgentMessage that carries the batch on this connection."""
        if self.compact and self.version < compact.VERSION:
            return self._older(batch)
        if self.ids or self.chain is not None:   # version 2
            data = batch if isinstance(batch, bytes) else batch.SerializeToString()
            if self.chain is not None:
                try:
                    if span := columns_span(data):
                        data = with_columns(data, self.chain.send(data[span[1]:span[2]]), span)
                except compact.CompactError as e:
                    raise Unsendable(f"its columns do not decode ({e})") from None
            return batch_message(without_ids(data, self.ids))
        return batch_message(batch) if isinstance(batch, bytes) else pb.AgentMessage(batch=batch)

    def _older(self, batch: pb.Batch | bytes) -> pb.AgentMessage:
        """The batch with its columns in this connection's version where they are in a newer one."""
        b = batch if isinstance(batch, pb.Batch) else pb.Batch.FromString(batch)
        if b.columns and compact.version_of(b.columns) > self.version:
            try:
                cols = compact.decode_columns(b.columns, MAX_ROWS)
            except compact.CompactError as e:
                raise Unsendable(f"its columns do not decode ({e})") from None
            older = pb.Batch()
            older.CopyFrom(b)
            older.columns = compact.encode_columns(cols.rows(), cols.histograms, self.version)
            b = older
        return pb.AgentMessage(batch=b)
