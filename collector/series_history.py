"""A series' history in the collector's memory: (time ns, value) points in two numeric arrays
(History): 16 bytes a point (an `array('q')` of times and an `array('d')` of values, ~6% spare
room) where a Python tuple of an int and a float in a deque takes ~150."""

from __future__ import annotations

from array import array

POINT_BYTES = 17   # 16, and the arrays' spare room (CPython grows them by 1/16)


class History:
    """Appending is two C calls; points older than the window are let go in bulk, once the oldest is
    `slack_ns` past it or the series holds `cap` + 1/8 points (a faster tier), so the per-point cost
    stays that of the append. Readers see only the points within the window (`points(cutoff)`), the
    newest `cap` at most. Points keep the order they arrived in (an agent clock stepping back
    appends an older point). `dropped` counts every point let go from the front (prune, shrink):
    `dropped + len(t)` is how many points the series ever held, so a snapshot can write only the
    points appended since the last one (collector/store/fleet_image.py). Points leave only through
    these two methods; the window is measured from the newest time the series has held (`newest`),
    never from a later-arriving older point."""

    __slots__ = ("t", "v", "due_t", "due_n", "dropped", "newest")

    def __init__(self) -> None:
        self.t = array("q")
        self.v = array("d")
        self.due_t = -1    # prune() once a point newer than this comes (set by the first prune)
        self.due_n = 0     # ...or once there are more points than this
        self.dropped = 0   # points let go from the front so far
        # The newest time among its points (stamps arrive out of order when an agent clock steps
        # back): the window is measured from it, so it only ever moves forward and what a prune lets
        # go does not depend on when the prune runs.
        self.newest = 0

    def prune(self, cutoff: int, cap: int, window_ns: int, slack_ns: int) -> int:
        """Let go of the points before `cutoff` at the front and all but the newest `cap`; returns
        how many went. Sets when the next prune is due."""
        ts = self.t
        n = len(ts)
        i = 0
        while i < n and ts[i] < cutoff:
            i += 1
        if n - i > cap:
            i = n - cap
        if i:
            del ts[:i]
            del self.v[:i]
            self.dropped += i
        self.due_t = (ts[0] if len(ts) else cutoff) + window_ns + slack_ns
        self.due_n = cap + max(4, cap >> 3)
        return i

    def shrink(self, cap: int) -> int:
        """Keep the newest `cap` points at most, in arrays of that size (memory given back); returns
        how many went."""
        n = len(self.t)
        if n <= cap:
            return 0
        self.t = array("q", self.t[n - cap:])
        self.v = array("d", self.v[n - cap:])
        self.dropped += n - cap
        self.due_n = cap + max(4, cap >> 3)
        return n - cap

    def __len__(self) -> int:
        return len(self.t)


def points_of(ts: array, vs: array, cutoff: int, cap: int) -> list[tuple[int, float]]:
    """(time ns, value) of the newest `cap` points at most, those at or after `cutoff`, in
    arrival order (oldest first)."""
    start = max(0, len(ts) - cap)
    return [(t, vs[i]) for i, t in enumerate(ts[start:], start) if t >= cutoff]
