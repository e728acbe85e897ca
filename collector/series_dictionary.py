"""The series definitions of the compact encoding (common/compact.py) the collector holds: per node
and agent boot, each series_ref's name, unit, kind and labels, as the agent's SeriesTables gave
them, and a compact batch's samples as the Sample encoding would have carried them, built as read
(`Expanded`, the fleet state's; a whole batch: compact.expand)."""

from __future__ import annotations

import collections
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import grpc

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from .limits import Violation, short_boot


class MissingDefinition(LookupError):
    """A compact batch uses a series_ref its boot has no definition for."""

    def __init__(self, node_id: str, boot_id: str, ref: int):
        super().__init__(f"no definition for series_ref {ref} of node {node_id[:128]!r} boot {short_boot(boot_id)!r} "
                         "(the agent sends one before the first batch using it on each stream)")
        self.node_id, self.boot_id, self.ref = node_id, boot_id, ref


class Expanded(Sequence[pb.Sample]):
    """A compact batch's samples as the Sample encoding would have carried them, each built only
    when read (the fleet state reads one for a new series or a histogram): its columns' rows, then
    the samples it carries whole. `held`: its boot's definitions, one for every ref of the columns."""

    __slots__ = ("held", "columns", "whole", "_values")

    def __init__(self, held: dict[int, pb.Sample], columns: compact.Columns, whole: Sequence[pb.Sample]):
        self.held, self.columns, self.whole = held, columns, whole
        self._values: array | None = None

    def __len__(self) -> int:
        return len(self.columns.refs) + len(self.whole)

    def _row(self, i: int) -> pb.Sample:
        if self._values is None:
            self._values = array("d", self.columns.values)
        ref = self.columns.refs[i]
        return compact.sample(self.held[ref], (ref, self.columns.times[i], self._values[i]),
                              self.columns.histograms.get(i))

    @overload
    def __getitem__(self, i: int) -> pb.Sample: ...
    @overload
    def __getitem__(self, i: slice) -> list[pb.Sample]: ...

    def __getitem__(self, i: int | slice) -> pb.Sample | list[pb.Sample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.columns.refs)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("sample index out of range")
        return self._row(i) if i < n else self.whole[i - n]

    def __iter__(self) -> Iterator[pb.Sample]:
        for i in range(len(self.columns.refs)):
            yield self._row(i)
        yield from self.whole


class SeriesDictionary:
    """(node, boot) -> {series_ref: definition}. A boot holds at most `max_per_boot` definitions:
    past that a table's further ones are dropped and counted (`hits`), and batches using them are
    refused as missing a definition, never read as something else."""

    def __init__(self, max_per_boot: int = 200_000):
        self.max_per_boot = max_per_boot
        self.boots: dict[tuple[str, str], dict[int, pb.Sample]] = {}
        # Per boot, the references of its last batch read (`columns`), every one defined in the
        # definitions held with them: its next round's are most often the same, taken as they are
        # rather than summed and looked up again (while the boot holds those definitions).
        self.last: dict[tuple[str, str], tuple[dict[int, pb.Sample], compact.Columns]] = {}
        self.hits: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return sum(len(d) for d in self.boots.values())

    def add(self, node_id: str, boot_id: str, defs: list[pb.Sample]) -> int:
        """A SeriesTable's definitions kept (one given again replaces the one held); how many were
        dropped over the bound is returned and counted. A definition without a ref is ignored."""
        held = self.boots.setdefault((node_id, boot_id), {})
        dropped = 0
        for d in defs:
            if not d.series_ref:
                continue
            if d.series_ref not in held and len(held) >= self.max_per_boot:
                dropped += 1
                continue
            d.ClearField("value")
            d.ClearField("time_unix_nano")
            d.ClearField("histogram")
            held[d.series_ref] = d
        if dropped:
            self.hits["limits.max_series_per_node.definitions_dropped"] += dropped
        return dropped

    def refusal(self, node_id: str, boot_id: str, defs: list[pb.Sample],
                check: Callable[[pb.Sample], Violation | None] | None) -> Violation | None:
        """Why a SeriesTable of `defs` is refused, else None: a definition past a sample's bounds
        (`check`, limits.check_definition; None: the stream has no limits), as those are held as long
        as the boot; or a ref the boot holds given another series (name, unit, kind or labels: a
        boot's refs never change meaning, so batches already stored keep the series they were read as)."""
        refused = f"SeriesTable of boot {short_boot(boot_id)} refused: "
        if check is not None:
            for d in defs:
                if (v := check(d)) is not None:
                    return Violation(v.code, refused + v.message.removeprefix("batch rejected: "), v.key)
        held = self.boots.get((node_id, boot_id)) or {}
        for d in defs:
            h = held.get(d.series_ref)
            if h is not None and (h.name != d.name or h.unit != d.unit or h.kind != d.kind or h.labels != d.labels):
                return Violation(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{refused}series_ref {d.series_ref} is defined as {h.name}{dict(h.labels)} in "
                                 f"this boot, not {d.name[:128]}{dict(list(d.labels.items())[:8])}")
        return None

    def definitions(self, node_id: str, boot_id: str) -> dict[int, pb.Sample]:
        return self.boots.get((node_id, boot_id)) or {}

    def defined_up_to(self, node_id: str, boot_id: str) -> int:
        """The largest N such that the boot holds a definition of every series_ref 1..N (a Welcome's
        `series_defined_up_to`): 0 where it holds none or lacks ref 1. O(definitions held)."""
        held = self.boots.get((node_id, boot_id)) or {}
        n = len(held)
        if n and max(held) == n:   # refs are positive and distinct: exactly 1..n (the usual case)
            return n
        top = 0
        while top + 1 in held:
            top += 1
        return top

    def check(self, node_id: str, boot_id: str, refs: tuple[int, ...] | list[int]) -> None:
        """MissingDefinition for the first of `refs` with no definition (0: a sample of its own)."""
        held = self.boots.get((node_id, boot_id)) or {}
        if all(map(held.__contains__, refs)):   # the usual batch, at C speed
            return
        for r in refs:
            if r and r not in held:
                raise MissingDefinition(node_id, boot_id, r)

    def columns(self, node_id: str, boot_id: str, data: bytes, max_samples: int) -> compact.Columns:
        """A compact batch's columns (compact.decode_columns), every ref of which the boot defines:
        compact.CompactError or MissingDefinition otherwise."""
        key = (node_id, boot_id)
        held = self.boots.get(key)
        last = self.last.get(key)
        like = last[1] if last is not None and last[0] is held else None
        got = compact.decode_columns(data, max_samples, like)
        if like is None or got.refs is not like.refs:
            self.check(node_id, boot_id, got.refs)
            if held is not None:
                self.last[key] = (held, compact.Columns(got.refs, [], b"", {}, got.rising, got.ref_deltas))
        return got

    def forget(self, node_id: str, boot_id: str | None = None) -> None:
        """A boot's definitions let go (every boot of the node: boot_id None)."""
        if boot_id is not None:
            self.boots.pop((node_id, boot_id), None)
            self.last.pop((node_id, boot_id), None)
        else:
            for key in [k for k in self.boots if k[0] == node_id]:
                del self.boots[key]
                self.last.pop(key, None)

    def image(self) -> list[tuple[str, str, bytes]]:
        """Everything held, as (node, boot, SeriesTable.defs) rows: what a snapshot keeps."""
        return [(node, boot, compact.encode_defs(held.values())) for (node, boot), held in self.boots.items()]

    def restore(self, image: list, max_bytes: int) -> None:
        """The rows of `image()` taken back (compact.CompactError where one does not decode)."""
        for node, boot, defs in image:
            self.add(node, boot, compact.decode_defs(defs, max_bytes))
