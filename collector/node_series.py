"""A node's series table, as the fleet state (state.py) and a cluster worker (cluster/summary.py)
keep it: the node's series by name and labels (series.series_key), and per agent boot the agent's
series references to them in two generations (idle.RefGenerations), bounded. What an entry is and
which series are kept is the owner's, passed in as `make`; what a new point does stays in the
owner's loop over a batch's rows, which looks a known reference up itself (no call a sample)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .idle import RefGenerations
from .series import read_labels, series_key

# References held in a boot's current generation where the owner gives no bound (its older one
# holds at most as many).
MAX_REFS = 65536
# A series the owner does not keep: its reference is remembered so that its samples are skipped
# without reading their labels again; never in `series`.
IGNORED: Any = object()


class BootRefs(RefGenerations[dict]):
    """A boot's series references -> entries, in two generations (idle.RefGenerations)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__({}, 0)

    def get(self, ref: int, default: Any = None) -> Any:
        e = self.cur.get(ref)
        return e if e is not None else self.old.get(ref, default)

    def items(self) -> Iterator[tuple[int, Any]]:
        yield from self.old.items()
        yield from self.cur.items()


class NodeSeries:
    """A node's series (`series`: series_key -> entry) and its boots' references (`refs`)."""

    __slots__ = ("series", "refs")

    def __init__(self) -> None:
        self.series: dict[tuple, Any] = {}
        self.refs: dict[str, BootRefs] = {}

    def boot_refs(self, boot: str) -> BootRefs:
        gens = self.refs.get(boot)
        if gens is None:
            gens = self.refs[boot] = BootRefs()
        return gens

    def entry_for(self, gens: BootRefs, ref: int, s: Any, make: Callable[[Any, Any, dict], Any], max_refs: int,
                  label_sets: dict[tuple, tuple] | None = None) -> Any:
        """The entry of sample `s`, whose reference `ref` (0: none) is not in `gens.cur`: the older
        generation's (back in use), else the series of its name and labels, made by
        make(self, s, labels) when new (None: none this time, nothing remembered; IGNORED: not
        kept). `label_sets`: the label sets read so far from the same batch, whose samples share
        them (a device's series): a new series takes the dict and the tuple already made.
        The reference is remembered in the current generation, which holds at most `max_refs`:
        past that the generations turn (references a client makes up cannot grow the table; one
        let go is found again by name and labels); `gens.cur` may be a new dict afterwards."""
        if ref and (e := gens.old.pop(ref, None)) is not None:
            gens.cur[ref] = e
            return e
        labels = read_labels(s.labels)
        key = series_key(s.name, labels)
        if label_sets is not None:
            if (seen := label_sets.get(key[1])) is None:
                label_sets[key[1]] = (key[1], labels)
            else:
                key, labels = (key[0], seen[0]), seen[1]
        e = self.series.get(key)
        if e is None:
            e = make(self, s, labels)
            if e is None:
                return None
            if e is not IGNORED:
                self.series[key] = e
        if ref:
            if len(gens.cur) >= max_refs:
                gens.turn(gens.turn_at)
            gens.cur[ref] = e
        return e

    def turn_refs(self, now_ns: int, every_ns: int) -> int:
        """Each boot's generations turned when due, every `every_ns` (an idle sweep's); the
        references let go (not used for a whole generation): returned."""
        gone = 0
        for gens in self.refs.values():
            if not gens.turn_at:
                gens.turn_at = now_ns + every_ns
            elif now_ns >= gens.turn_at:
                gone += gens.turn(now_ns + every_ns)
        return gone

    def forget_refs_to(self, dead: set) -> None:
        """The references to the entries `dead` (series let go) forgotten, in every boot."""
        for gens in self.refs.values():
            for refs in (gens.cur, gens.old):
                for r in [r for r, e in refs.items() if e in dead]:
                    del refs[r]
