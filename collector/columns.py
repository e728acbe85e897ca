"""A node's series that come at the same times, held in columns (a Frame): one array of times for
all of them and their values row by row, so that a group of a batch's samples (one time; sorted by
series_ref, its refs and boot are its frame's key) is stored with two C calls, not two appends and
four attribute writes a sample on objects spread over the heap. Groups without their frame go
through the fleet state's general path and become frames where they can (`form`); a frame the
general path touches is dissolved back into its members' own Histories (`dissolve`)."""

from __future__ import annotations

import bisect
import operator
from array import array
from typing import Any

from xpusense.v1 import telemetry_pb2 as pb

_REF = operator.itemgetter(0)
_TIME = operator.itemgetter(1)
# After a frame of a node is dissolved, the node forms none for HOLD_FIRST_NS, twice as long after
# each dissolve that follows (up to HOLD_MAX_NS), until one of its frames reaches STEADY_ROWS rows:
# a node whose groups keep changing stays on the general path instead of moving points back and
# forth (an agent's first batch of a boot, often a few series short, costs one short hold).
HOLD_FIRST_NS = 10**9
HOLD_MAX_NS = 300 * 10**9
STEADY_ROWS = 64
# What a value in a frame's rows holds, and a row's time: 8 bytes and the array's spare room (1/16).
# FleetState counts them (frame_points, frame_rows) for its memory estimate; a point in a History
# costs history.POINT_BYTES (a time and a value).
FRAME_POINT_BYTES = 9


class Frame:
    """A group's series in columns. A member's points from before the frame stay in its own History
    (all older than the rows), let go by time and the history's cap as rows come; its latest and
    previous values are read off the last two rows (Series.value and the others are properties).
    A group whose point would be at or before the last row goes through the general path, so points
    keep the order they arrived in."""

    __slots__ = ("key", "series", "k", "t", "v", "dropped", "due_t", "due_n", "last_t", "prefixed", "recv_ns")

    def __init__(self, key: tuple, members: list, last_t: int):
        self.key = key
        self.series = members      # the columns, in the order of their refs
        self.k = len(members)
        self.t = array("q")        # a time a row, strictly rising
        self.v = array("d")        # row-major: row i is v[i * k:(i + 1) * k]
        self.dropped = 0           # rows let go from the front
        self.due_t = -1            # prune() once a row newer than this comes...
        self.due_n = 0             # ...or once there are more rows than this
        self.last_t = last_t       # a row must be newer than this (the members' latest point when formed)
        self.prefixed = True       # some member may still hold points of its own (all older than the rows)
        self.recv_ns = 0           # its last row's time on the collector's clock (0: not known; clock.py)


def groups(batch_rows: list) -> dict[int, list]:
    """The batch's (ref, time, value) rows by time, in the order each time first comes."""
    times = list(map(_TIME, batch_rows))
    if times.count(times[0]) == len(times):   # the usual batch: one round, one time
        return {times[0]: batch_rows}
    out: dict[int, list] = {}
    for r in batch_rows:
        g = out.get(r[1])
        if g is None:
            out[r[1]] = [r]
        else:
            g.append(r)
    return out


def store(state: Any, n: Any, boot: str, by_time: dict[int, list]) -> set[int] | None:
    """Each group that has its frame, a row on it (each group is sorted by ref here, in place in
    `by_time`); the times of the groups left to the general path, or None when there are none."""
    frames = n.frames
    slow = None
    for t, g in by_time.items():
        g = by_time[t] = sorted(g)
        f = frames.get((boot, *map(_REF, g)))
        if f is None or t <= f.last_t:
            if slow is None:
                slow = {t}
            else:
                slow.add(t)
            continue
        f.v.fromlist([r[2] for r in g])
        _row_added(state, n, f, t)
    return slow


def store_row(state: Any, n: Any, key: tuple, t: int, values: bytes) -> bool:
    """A batch of one group, its refs rising (batch_rows.BatchRows read as columns): its row on its
    frame, `key` (boot, *refs), with `values` the bytes of its array('d'). False when that frame
    does not take it (none, or a row not newer than its last): the general path stores it."""
    f = n.frames.get(key)
    if f is None or t <= f.last_t:
        return False
    f.v.frombytes(values)
    _row_added(state, n, f, t)
    return True


def _row_added(state: Any, n: Any, f: Frame, t: int) -> None:
    """The row at `t` whose values were just put on f.v: its time, the counts, a prune when due."""
    f.t.append(t)
    f.last_t = t
    r = t + n.recv_shift   # its time on the collector's clock (clock.received_at)
    f.recv_ns = r if r < n.recv_ns else n.recv_ns
    grown = f.k
    state.frame_rows += 1
    if len(f.t) == STEADY_ROWS:
        n.frames_dissolves = 0
    state.frame_points += f.k
    if t > f.due_t or len(f.t) > f.due_n:
        grown -= prune(state, f)
    state.history_slots += grown


def form(state: Any, n: Any, boot: str, by_time: dict[int, list], times: set[int]) -> None:
    """Frames for the groups at `times`, stored by the general path just now, where they can be:
    series all on their own, known by ref, not histograms, with this group's point their latest."""
    if not n.frames_allowed(state.clock()):
        return
    known = n.refs.get(boot)
    if not known:
        return
    for t in times:
        g = by_time[t]
        if len(g) < 2:   # one series shares nothing: its own History serves as well
            continue
        refs = tuple(map(_REF, g))
        if not refs[0] or len(set(refs)) != len(refs):   # ref 0: none given; a ref twice: two points of a series
            continue
        members = [known.get(r) for r in refs]
        # A frame's rows are newer than every point its members hold (an agent clock stepped back
        # leaves newer points in their histories: no frame until the rows pass them).
        if not all(s is not None and s.frame is None and s.kind != pb.HISTOGRAM and s._time_ns == t
                   and s.history.newest <= t for s in members):
            continue
        f = Frame((boot, *refs), members, t)
        f.recv_ns = members[0]._recv_ns
        for col, s in enumerate(members):
            s.frame, s.col = f, col
        n.frames[f.key] = f
        state.counters["state.columns.formed"] += 1


def adopt(state: Any, n: Any, key: tuple, members: list, t: array, v: array, last_t: int, due_t: int,
          due_n: int) -> Frame:
    """A frame as a snapshot held it (collector/store/fleet_image.py): its rows `t` and `v` taken as they
    are, counted in frame_rows and frame_points (the caller counts them in history_slots). A member
    with rows holds, in its own latest fields, its point before them (its previous value while the
    frame has one row): the restore sets them."""
    f = Frame(key, members, last_t)
    f.t, f.v, f.due_t, f.due_n = t, v, due_t, due_n
    f.prefixed = any(len(s.history.t) for s in members)
    for col, s in enumerate(members):
        s.frame, s.col = f, col
    n.frames[key] = f
    state.frame_rows += len(t)
    state.frame_points += len(t) * f.k
    return f


def dissolve(state: Any, n: Any, f: Frame) -> None:
    """Every member's points back in its own History, its latest values in its own fields."""
    rows, k = len(f.t), f.k
    for col, s in enumerate(f.series):
        h = s.history
        if rows:
            if rows >= 2:
                s._prev_value, s._prev_time_ns = f.v[(rows - 2) * k + col], f.t[-2]
            else:
                s._prev_value, s._prev_time_ns = s._value, s._time_ns
            s._value, s._time_ns = f.v[(rows - 1) * k + col], f.t[-1]
            if f.recv_ns:   # else as it was (a frame restored from a snapshot: not known)
                s._recv_ns = f.recv_ns
            h.t.extend(f.t)
            h.v.extend(f.v[col::k])
            h.newest = max(h.newest, f.t[-1])
        h.dropped += f.dropped
        h.due_t = -1   # pruned at its next point
        s.frame = None
    state.frame_rows -= rows
    state.frame_points -= rows * k
    n.frames.pop(f.key, None)
    n.frames_dissolves += 1
    n.frames_hold_until = state.clock() + min(HOLD_MAX_NS, HOLD_FIRST_NS << min(n.frames_dissolves - 1, 16))
    state.counters["state.columns.dissolved"] += 1


def shrink(state: Any, f: Frame, cap: int) -> int:
    """The newest `cap` points of each member at most, in arrays of that size (memory given back);
    the frame stays. Returns the points let go."""
    rows = len(f.t)
    gone = _drop_rows(state, f, rows - cap, give_back=True) if rows > cap else 0
    if f.prefixed:
        room = cap - len(f.t)
        for s in f.series:
            gone += s.history.shrink(room)
        f.prefixed = any(len(s.history.t) for s in f.series)
    f.due_n = cap + max(4, cap >> 3) - max((len(s.history.t) for s in f.series), default=0)
    return gone


def prune(state: Any, f: Frame) -> int:
    """Let go of the rows (and the members' older points) before the window or past the history's
    cap; sets when the next prune is due. Returns the points let go."""
    hist_ns, cap = state.history_ns, state.history_cap
    slack_ns = hist_ns >> 5
    ts = f.t
    cutoff = ts[-1] - hist_ns
    i = bisect.bisect_left(ts, cutoff)
    if len(ts) - i > cap:
        i = len(ts) - cap
    gone = _drop_rows(state, f, i, give_back=False) if i else 0   # in place: ts is still f.t
    oldest, longest = ts[0], 0
    if f.prefixed:
        room = cap - len(ts)
        for s in f.series:
            h = s.history
            if len(h.t):
                gone += h.prune(cutoff, max(0, room), hist_ns, slack_ns)
                if len(h.t):
                    oldest = min(oldest, h.t[0])
                    longest = max(longest, len(h.t))
        f.prefixed = longest > 0
    f.due_t = oldest + hist_ns + slack_ns
    f.due_n = max(1, cap + max(4, cap >> 3) - longest)
    return gone


def _drop_rows(state: Any, f: Frame, i: int, give_back: bool) -> int:
    """Let rows [0, i) go (in arrays of the new size when `give_back`, memory returned); returns the
    points let go. Row i - 1 becomes each member's point before the rows (its own latest fields,
    which its previous value is read from while the frame has one row)."""
    k, t = f.k, f.t[i - 1]
    for col, s in enumerate(f.series):
        s._value, s._time_ns = f.v[(i - 1) * k + col], t
    if give_back:
        f.t, f.v = array("q", f.t[i:]), array("d", f.v[i * k:])
    else:
        del f.t[:i]
        del f.v[:i * k]
    f.dropped += i
    state.frame_rows -= i
    state.frame_points -= i * k
    return i * k


def held(s: Any) -> tuple[array, array]:
    """A series' points as two arrays: its own, then its frame's column."""
    h, f = s.history, s.frame
    if f is None:
        return h.t, h.v
    col = f.v[s.col::f.k]
    if len(h.t):
        return h.t + f.t, h.v + col
    return f.t, col
