"""A multiset of numbers that says how many are at least x without looking at each (sorted blocks,
as sortedcontainers' SortedList, and the counts asked since it last changed): what lets a decision
count the nodes that fit a request in O(log n) (docs/scheduler.md "The index")."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

LOAD = 512
MEMO_MAX = 8   # thresholds whose count a multiset keeps until it changes (more: the kept ones dropped)


class Ranked:
    """A sorted multiset of numbers (no NaN: it would break the order)."""
    __slots__ = ("blocks", "maxes", "size", "memo")

    def __init__(self, values: Sequence[float] = ()):
        self.blocks: list[list[float]] = []
        self.maxes: list[float] = []
        self.size = 0
        self.memo: dict[float, int] = {}   # x -> at_least(x), until the next change
        for v in sorted(values):
            self.add(v)

    def __len__(self) -> int:
        return self.size

    def values(self) -> list[float]:
        return [v for b in self.blocks for v in b]

    def add(self, v: float) -> None:
        maxes, blocks = self.maxes, self.blocks
        self.size += 1
        if self.memo:
            self.memo.clear()
        if not maxes:
            blocks.append([v])
            maxes.append(v)
            return
        i = bisect_left(maxes, v)
        if i == len(maxes):   # above every number: the end of the last block
            i -= 1
        b = blocks[i]
        insort(b, v)
        maxes[i] = b[-1]
        if len(b) > 2 * LOAD:
            self._split(i)

    def remove(self, v: float) -> None:
        """Take one `v` out; ValueError when there is none."""
        i, j = self._find(v)
        b = self.blocks[i]
        del b[j]
        self.size -= 1
        if self.memo:
            self.memo.clear()
        if b:
            self.maxes[i] = b[-1]
        if len(b) <= LOAD // 4:
            self._shrunk(i)

    def replace(self, old: float, new: float) -> None:
        """remove(old) and add(new) in one go; ValueError when there is no `old`."""
        maxes, blocks = self.maxes, self.blocks
        i, j = self._find(old)
        if self.memo:
            self.memo.clear()
        b = blocks[i]
        k = bisect_left(maxes, new)
        if k == len(maxes):
            k -= 1
        if k == i:   # the usual case: a node's free HBM moved within its block
            del b[j]
            insort(b, new)
            maxes[i] = b[-1]
            return
        del b[j]
        t = blocks[k]
        insort(t, new)
        maxes[k] = t[-1]
        if b:
            maxes[i] = b[-1]
        if len(t) > 2 * LOAD:
            self._split(k)
            if i > k:
                i += 1
        if len(b) <= LOAD // 4:
            self._shrunk(i)

    @staticmethod
    def replace_each(sets: Sequence[Ranked], old: Sequence[float], new: Sequence[float]) -> None:
        """sets[k].replace(old[k], new[k]) where the two differ (a set of one block done here)."""
        for values, o, n in zip(sets, old, new):
            if o == n:
                continue
            if len(values.maxes) != 1:
                values.replace(o, n)
                continue
            b = values.blocks[0]
            j = bisect_left(b, o)
            if j == len(b) or b[j] != o:
                raise ValueError(f"{o!r} is not in the multiset")
            if values.memo:
                values.memo.clear()
            del b[j]
            insort(b, n)
            values.maxes[0] = b[-1]

    def at_least(self, x: float) -> int:
        """How many numbers are >= x."""
        memo = self.memo
        n = memo.get(x)
        if n is not None:
            return n
        maxes = self.maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            n = 0
        else:
            b = self.blocks[i]
            n = len(b) - bisect_left(b, x)
            if i + 1 < len(maxes):
                n += sum(map(len, self.blocks[i + 1:]))
        if len(memo) >= MEMO_MAX:
            memo.clear()
        memo[x] = n
        return n

    def _find(self, v: float) -> tuple[int, int]:
        """(block, place in it) of one `v`."""
        i = bisect_left(self.maxes, v)
        if i < len(self.maxes):
            b = self.blocks[i]
            j = bisect_left(b, v)
            if b[j] == v:   # j < len(b): the block's max is >= v
                return i, j
        raise ValueError(f"{v!r} is not in the multiset")

    def _split(self, i: int) -> None:
        b = self.blocks[i]
        self.blocks.insert(i + 1, b[LOAD:])
        del b[LOAD:]
        self.maxes[i] = b[-1]
        self.maxes.insert(i + 1, self.blocks[i + 1][-1])

    def _shrunk(self, i: int) -> None:
        """Block i got small: gone when empty, else merged into a neighbour (split again if big)."""
        blocks, maxes = self.blocks, self.maxes
        if not blocks[i]:
            del blocks[i]
            del maxes[i]
            return
        if len(blocks) == 1:
            return
        k = i if i + 1 < len(blocks) else i - 1   # blocks k and k + 1 become one
        blocks[k] += blocks[k + 1]
        del blocks[k + 1]
        del maxes[k + 1]
        maxes[k] = blocks[k][-1]
        if len(blocks[k]) > 2 * LOAD:
            self._split(k)
