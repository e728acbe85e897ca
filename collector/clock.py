"""Agent clocks as the collector sees them: per node an estimate of how far its clock is off the
collector's (ClockOffset), an agent's stamp put on the collector's clock (received_at), and the
node-wide `clock_offset` diagnosis for a node more than `[state] max_clock_offset_s` off (check).
The collector decides on when things were received, never on the stamps, which are shown as sent:
docs/diagnosis.md "Agent clocks"."""

from __future__ import annotations

import json

from xpusense.v1 import telemetry_pb2 as pb

from .diagnoses import CAUSE, CLOSED, EVIDENCE, ID, OPEN, OPENED, REMEDY, RULE, STATE, SYMPTOM, TYPE, Diagnoses

WINDOW_NS = 30 * 10**9
OPEN_BEHIND_SAMPLES = 2   # a clock behind opens a diagnosis on this many samples in the windows at least
RULE_NAME = "clock_offset"
DIAGNOSIS_ID = "collector.clock_offset"
OFFSET = "clock.offset_s"
SYMPTOM_TEXT = "agent clock off the collector's"
REMEDY_TEXT = ("synchronise the node's clock (chrony or NTP); meanwhile the collector judges its readings and events "
               "by when they arrived")


def shift_of(sent: int, recv: int) -> int:
    """What puts a stamp of a batch built at `sent` (the agent's clock; 0: not known) and received
    at `recv` on the collector's clock: stamp + shift, capped at `recv` (received_at)."""
    return recv - sent if sent else recv


def received_at(stamp: int, sent: int, recv: int) -> int:
    """An agent's `stamp` (of an event or sample in a batch the agent built at `sent`, its clock)
    on the collector's clock, the batch received at `recv`: as long before `recv` as it was before
    `sent` (an interval of the agent's own clock), never after `recv`; `recv` where one is missing."""
    if not stamp:
        return recv
    return min(recv, stamp + shift_of(sent, recv))


def events_received(node, batch) -> list[int]:
    """When each event of a stored batch happened, on the collector's clock: a cluster replica's
    changes carry them (`received_ns`, the worker's); FleetState's batch was received at its node's
    `recv_ns`."""
    got = getattr(batch, "received_ns", None)
    if got is not None:
        return got
    sent, recv = batch.sent_unix_nano, node.recv_ns
    return [received_at(e.time_unix_nano, sent, recv) for e in batch.events]


class ClockOffset:
    """The estimate of one node's clock offset (agent - collector, ns): the highest sample of the
    current window and the one before. Each Hello's `time_unix_nano` and each batch's
    `sent_unix_nano` against when it was received is a sample of the offset less the delay on the
    way (network, queues, the agent's spool), which only lowers it; two windows' maxima keep it O(1)
    a node, and a clock stepped back shows within 2 x WINDOW_NS. A batch resent from the spool is a
    low sample, outweighed by any fresh one in the windows."""

    __slots__ = ("cur", "prev", "since", "reported", "samples", "prev_samples")

    def __init__(self) -> None:
        self.cur: int | None = None
        self.prev: int | None = None
        self.since = 0          # when (collector clock) the current window began
        self.reported: int | None = None   # the offset the open diagnosis names (check), where known
        self.samples = self.prev_samples = 0   # in the current window, in the one before

    def observe(self, agent_ns: int, recv_ns: int) -> None:
        """A message the agent stamped `agent_ns` (0: not stamped, ignored), received at `recv_ns`."""
        if not agent_ns:
            return
        if recv_ns - self.since >= WINDOW_NS:
            near = recv_ns - self.since < 2 * WINDOW_NS
            self.prev, self.prev_samples = (self.cur, self.samples) if near else (None, 0)
            self.cur, self.since, self.samples = None, recv_ns, 0
        self.samples += 1
        sample = agent_ns - recv_ns
        if self.cur is None or sample > self.cur:
            self.cur = sample

    @property
    def ns(self) -> int | None:
        """The estimate; None before any sample."""
        if self.prev is None:
            return self.cur
        return self.prev if self.cur is None else max(self.cur, self.prev)


def describe(offset_ns: int) -> str:
    s = offset_ns / 1e9
    side = "ahead of" if s > 0 else "behind"
    days = f" ({abs(s) / 86400:.1f} days)" if abs(s) >= 86400 else ""
    return f"the node's clock is {abs(s):.1f} s{days} {side} the collector's"


def check(book: Diagnoses, n, bound_ns: int, now_ns: int) -> pb.Event | None:
    """Open, update or close node `n`'s clock_offset diagnosis (held by `book`, as the agent's are)
    for its estimate `n.offset`; the event made, or None when nothing changed."""
    est = n.offset
    offset = est.ns or 0
    skewed = offset > bound_ns or -offset > bound_ns
    held = n.diagnoses.get(DIAGNOSIS_ID)
    if held is None:
        # A clock behind is also what one delayed message shows (a Hello or batch held up in a
        # collector that many agents reach at once): one sample never opens it; one ahead cannot be.
        if not skewed or (offset < 0 and est.samples + est.prev_samples < OPEN_BEHIND_SAMPLES):
            return None
    elif skewed:
        if est.reported is None:   # opened before this process knew the node (a snapshot, a takeover)
            try:
                est.reported = int(float(held.attributes.get(OFFSET, "")) * 1e9)
            except ValueError:
                est.reported = 0
        if abs(est.reported - offset) <= bound_ns:
            return None
    est.reported = offset if skewed else None
    offset_s = offset / 1e9
    opened = held.attributes.get(OPENED, str(now_ns)) if held is not None else str(now_ns)
    cause = describe(offset) if skewed else "the node's clock is back within the bound"
    e = pb.Event(id=f"{DIAGNOSIS_ID}-{now_ns}", type=TYPE, severity="warning" if skewed else "info",
                 message=f"{SYMPTOM_TEXT}: {cause}; remedy: {REMEDY_TEXT}" if skewed else f"resolved: {cause}",
                 time_unix_nano=now_ns, attributes={
                     ID: DIAGNOSIS_ID, STATE: OPEN if skewed else CLOSED, RULE: RULE_NAME, SYMPTOM: SYMPTOM_TEXT,
                     CAUSE: cause, REMEDY: REMEDY_TEXT, OPENED: opened, OFFSET: f"{offset_s:.3f}",
                     EVIDENCE: json.dumps([{"series": "", "labels": {}, "values": [round(offset_s, 3)],
                                            "window_s": 2 * WINDOW_NS / 1e9,
                                            "summary": "agent send times against their arrival, the least "
                                                       f"delayed; bound {bound_ns / 1e9:g} s"}])})
    book.event(n, e)
    return e
