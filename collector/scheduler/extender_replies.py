"""The extender's filter and prioritize replies for one list of node names, made from verdicts: each
node's verdict by its position in the list, and each reply's JSON kept per chunk of CHUNK positions.
Kept (verdict_cache.py), a list is patched with the verdicts judged again since it was last asked;
only the chunks whose verdicts changed (filter), or whose scores or their scale moved (prioritize),
are encoded again. A call over 5,000 nodes then joins ~80 pieces instead of 5,000."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress
from json.encoder import encode_basestring_ascii as _json
from operator import attrgetter, not_

from .verdicts import Verdict

CHUNK = 64
MAX_PRIORITY = 10   # extenderv1.MaxExtenderPriority
# Place's reasons that no preemption on the node can change: FailedAndUnresolvableNodes.
UNRESOLVABLE = frozenset({"unknown", "type", "count", "region", "residency", "encryption", "attestation"})
_FITS, _ENTRY, _REASON = attrgetter("fits"), attrgetter("entry"), attrgetter("reason")
_HOST = '{"Host":'
_SCORES = [f',"Score":{k}}}' for k in range(MAX_PRIORITY + 1)]   # each score's end of a HostPriority


def fleet_ids(k8s_nodes: dict[str, str], names: list[str]) -> list[str]:
    """The fleet node of each Kubernetes node name: the one whose inventory label `k8s_node` names
    it (FleetView.k8s_nodes), else the node of that id."""
    return list(map(k8s_nodes.get, names, names)) if k8s_nodes else names


def filter_sections(names: list[str], verdicts: list[Verdict]) -> tuple[str, str, str]:
    """(passing names, FailedNodes entries, FailedAndUnresolvableNodes entries) as JSON without their
    brackets: map and compress, no Python-level step per node."""
    fits = list(map(_FITS, verdicts))
    fails = list(map(not_, fits))
    failing = list(compress(verdicts, fails))
    entries = list(map(str.__add__, map(_json, compress(names, fails)), map(_ENTRY, failing)))
    hopeless = list(map(UNRESOLVABLE.__contains__, map(_REASON, failing)))
    return (",".join(map(_json, compress(names, fits))), ",".join(compress(entries, map(not_, hopeless))),
            ",".join(compress(entries, hopeless)))


def priorities_piece(names: list[str], verdicts: list[Verdict], best: float) -> str:
    """HostPriority entries, without brackets: Place's score relative to `best` (10), 0 for a node
    that cannot take the pod."""
    if best <= 0:
        return ",".join(_HOST + _json(n) + _SCORES[0] for n in names)
    return ",".join(_HOST + _json(n) + (_SCORES[max(0, round(MAX_PRIORITY * v.score / best))] if v.fits
                                       else _SCORES[0])
                    for n, v in zip(names, verdicts))


class Replies:
    """The replies over `names` (fleet node `ids`, position by position) from their `verdicts`.
    `k8s_changes`: FleetView.k8s_changes when the ids were worked out (a kept list whose labels
    moved is made anew)."""

    def __init__(self, names: list[str], ids: list[str], verdicts: list[Verdict], k8s_changes: int = 0):
        self.names, self.ids, self.verdicts, self.k8s_changes = names, ids, verdicts, k8s_changes
        chunks = (len(names) + CHUNK - 1) // CHUNK
        self.filter_parts: list[tuple[str, str, str] | None] = [None] * chunks
        self.score_parts = [""] * chunks     # "": to be made
        self.scaled_by = [0.0] * chunks      # the best score each of score_parts was made with
        self.chunk_best = [-1.0] * chunks    # each chunk's best fitting score; -1: to be worked out
        self.positions: dict[str, int] | None = None    # fleet id -> its first position, made at the first patch
        self.more: dict[str, list[int]] = {}            # fleet id -> its other positions (two names, one node)

    def fits(self) -> list[bool]:
        return list(map(_FITS, self.verdicts))

    def patch(self, fresh: Iterable[Verdict]) -> None:
        """Take the verdicts judged again; a changed one marks its chunk to be encoded again."""
        if self.positions is None:
            made: dict[str, int] = {}
            for i, nid in enumerate(self.ids):
                if made.setdefault(nid, i) != i:
                    self.more.setdefault(nid, []).append(i)
            self.positions = made
        pos, more, verdicts = self.positions, self.more, self.verdicts
        for v in fresh:
            at = pos.get(v.node_id)
            if at is None:
                continue
            for j in (at, *more[v.node_id]) if v.node_id in more else (at,):
                old = verdicts[j]
                if old == v:
                    continue
                verdicts[j] = v
                c = j // CHUNK
                if old.fits != v.fits or old.entry != v.entry:
                    self.filter_parts[c] = None
                if old.fits != v.fits or old.score != v.score:
                    self.score_parts[c], self.chunk_best[c] = "", -1.0

    def filter_sections(self) -> tuple[str, str, str]:
        """filter_sections() over every position, from the kept chunks."""
        parts = self.filter_parts
        made = [filter_sections(*self._chunk(c)) if part is None else part for c, part in enumerate(parts)]
        parts[:] = made
        return (",".join(filter(None, (p[0] for p in made))), ",".join(filter(None, (p[1] for p in made))),
                ",".join(filter(None, (p[2] for p in made))))

    def priorities(self) -> str:
        """HostPriorityList's JSON: each fitting node's score relative to the best of them (10)."""
        tops = self.chunk_best
        for c, top in enumerate(tops):
            if top < 0:
                tops[c] = max((v.score for v in self._chunk(c)[1] if v.fits), default=0.0)
        best = max(tops, default=0.0)
        parts, scaled = self.score_parts, self.scaled_by
        for c, part in enumerate(parts):
            if not part or scaled[c] != best:
                parts[c], scaled[c] = priorities_piece(*self._chunk(c), best), best
        return "[" + ",".join(parts) + "]"

    def _chunk(self, c: int) -> tuple[list[str], list[Verdict]]:
        """Chunk c's names and verdicts."""
        return self.names[c * CHUNK:(c + 1) * CHUNK], self.verdicts[c * CHUNK:(c + 1) * CHUNK]
