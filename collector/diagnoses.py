"""Diagnosis events at the collector (docs/diagnosis.md "At the collector"): per node the diagnoses
open now, opened and closed by the agent's `diagnosis` events, and per rule how many were opened.
It runs on the collector's event loop thread, inside FleetState's hello/apply; cluster mode's
workers run the same on their NodeLatest, whose `diagnosis_counts` and `diagnoses_opened` dicts
count per node as well, for the summary."""

from __future__ import annotations

import collections
import json

from xpusense.common.diagnosis_event import (
    CAUSE,
    CLOSED,
    EVIDENCE,
    ID,
    OPEN,
    OPENED,
    REMEDY,
    RULE,
    STATE,
    SYMPTOM,
    TYPE,
)
from xpusense.v1 import telemetry_pb2 as pb

__all__ = ["CAUSE", "CLOSED", "EVIDENCE", "ID", "OPEN", "OPENED", "REMEDY", "RULE", "STATE", "SYMPTOM", "TYPE",
           "Diagnoses", "diagnosis_id", "evidence", "opened_ns"]

BOUND_KEY = "state.max_open_diagnoses_per_node"
NEW_BOOT_KEY = "diagnoses.closed_by_new_boot"


def diagnosis_id(e: pb.Event) -> str:
    return e.attributes.get(ID) or e.id


def opened_ns(e: pb.Event) -> int:
    """When the diagnosis opened: its `diagnosis.opened_unix_nano`, else the open event's time."""
    raw = e.attributes.get(OPENED, "")
    return int(raw) if raw.isdigit() else e.time_unix_nano


def evidence(e: pb.Event) -> list:
    """The evidence list of a diagnosis event ([] when absent or not JSON)."""
    try:
        got = json.loads(e.attributes.get(EVIDENCE, "") or "[]")
    except ValueError:
        return []
    return got if isinstance(got, list) else []


class Diagnoses:
    """The fleet's open diagnoses: FleetState holds one, and each NodeState a `diagnoses` dict
    (diagnosis id -> open Event, oldest first) and the `diagnoses_boot` they belong to.

    The agent sends a diagnosis as an ordinary Event (type "diagnosis") when it opens and again when
    it closes, with the same `diagnosis.id`. Per node the open event of each diagnosis not closed yet
    is kept (a copy: the batch is not kept alive), at most `max_open_per_node`: past it the oldest is
    let go, counted as BOUND_KEY. Diagnoses belong to the agent boot that opened them: when the
    node's agent starts again (a Hello, or the node's current boot storing a batch, with another
    boot id) the earlier boot's are closed, counted as NEW_BOOT_KEY. An open event of a boot other
    than the node's current one (a resend of an ended boot's batches) opens nothing."""

    def __init__(self, counters: collections.Counter, max_open_per_node: int = 64):
        self.counters = counters                  # FleetState.counters (shown with every ListNodes reply)
        self.max_open_per_node = max_open_per_node
        self.opened: collections.Counter[str] = collections.Counter()   # rule -> diagnoses opened

    def hello(self, n, boot_id: str) -> None:
        """A Hello of boot `boot_id`: another boot's diagnoses end with it."""
        if boot_id != n.diagnoses_boot:
            self._new_boot(n, boot_id)

    def batch(self, n, batch: pb.Batch) -> None:
        """A stored batch of node `n` (after n.boot_id was brought up to date)."""
        current = True
        if batch.boot_id != n.diagnoses_boot:
            if not n.diagnoses_boot or batch.boot_id == n.boot_id:
                self._new_boot(n, batch.boot_id)
            else:
                current = False   # an ended boot's batch, resent: it closes, never opens
        for e in batch.events:
            if e.type == TYPE:
                self.event(n, e, current)

    def event(self, n, e: pb.Event, current: bool = True) -> None:
        did = diagnosis_id(e)
        state = e.attributes.get(STATE, "")
        held: collections.OrderedDict = n.diagnoses
        if state == CLOSED:
            held.pop(did, None)
            return
        if state != OPEN or not current or not did:
            return
        kept = pb.Event()
        kept.CopyFrom(e)
        if did in held:   # the same diagnosis again (an update): its place stays, its event is the newer
            held[did] = kept
            return
        while len(held) >= self.max_open_per_node:
            held.popitem(last=False)
            self._count(n, BOUND_KEY, 1)
        held[did] = kept
        rule = e.attributes.get(RULE, "") or "unknown"
        self.opened[rule] += 1
        per_node = getattr(n, "diagnoses_opened", None)
        if per_node is not None:
            per_node[rule] = per_node.get(rule, 0) + 1

    def _new_boot(self, n, boot_id: str) -> None:
        if n.diagnoses:
            self._count(n, NEW_BOOT_KEY, len(n.diagnoses))
            n.diagnoses.clear()
        n.diagnoses_boot = boot_id

    def _count(self, n, key: str, k: int) -> None:
        self.counters[key] += k
        per_node = getattr(n, "diagnosis_counts", None)   # a cluster worker's node: counted in its summary too
        if per_node is not None:
            per_node[key] = per_node.get(key, 0) + k

    def configure(self, max_open_per_node: int) -> None:
        self.max_open_per_node = max(1, int(max_open_per_node))


def open_diagnoses(events) -> list[pb.Event]:
    """Diagnosis events that say open, from a list of events (a node view's `diagnoses`)."""
    return [e for e in events if e.type == TYPE and e.attributes.get(STATE) == OPEN]
