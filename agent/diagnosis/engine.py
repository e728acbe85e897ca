"""The diagnosis engine: rules' findings -> `diagnosis` events, opened and closed with hysteresis.

It sits beside the HBM watch between the tier loop and the stream (agent/daemon.py `_sink`): every
round's samples go into `Recent`, and at most every `check_every_s` each rule says what it finds. A
finding that holds for `open_after_s` opens a diagnosis, one absent for `close_after_s` closes it,
one that comes and goes faster opens nothing; at most `max_open` are open (past it: `refused`).
The event's contract: docs/diagnosis.md "The event"."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable

from xpusense.common import diagnosis_event as ev

from ..sources.base import Event, Sample
from .base import Finding, Rule
from .recent import Recent

log = logging.getLogger("xpusense.agent.diagnosis")

@dataclasses.dataclass
class _Track:
    first_ns: int
    last_ns: int
    finding: Finding
    id: str = ""          # set once opened
    opened_ns: int = 0


class Diagnoser:
    def __init__(self, rules: Iterable[Rule], open_after_s: float = 30.0, close_after_s: float = 60.0,
                 check_every_s: float = 1.0, keep_s: float = 300.0, max_open: int = 64,
                 clock: Callable[[], int] = time.time_ns):
        self.rules = list(rules)
        self.open_after_ns, self.close_after_ns = int(open_after_s * 1e9), int(close_after_s * 1e9)
        self.check_every_ns = int(check_every_s * 1e9)
        self.max_open = max_open
        self.clock = clock
        self.recent = Recent({n for r in self.rules for n in r.reads}, keep_s=keep_s)
        self._tracks: dict[tuple[str, str, str], _Track] = {}
        self._checked_ns = 0
        self.opened = 0
        self.closed = 0
        self.refused = 0        # findings not opened: max_open diagnoses were open
        self.rule_errors = 0

    def open_now(self) -> list[Finding]:
        return [t.finding for t in self._tracks.values() if t.id]

    def observe(self, samples: list[Sample]) -> list[Event]:
        self.recent.add(samples)
        now = max((s.time_ns for s in samples), default=0) or self.clock()
        if now - self._checked_ns < self.check_every_ns:
            return []
        self._checked_ns = now
        found: dict[tuple[str, str, str], Finding] = {}
        for rule in self.rules:
            held = frozenset((k[1], k[2]) for k, t in self._tracks.items() if t.id and k[0] == rule.name)
            try:
                for f in rule.check(self.recent, now, held):
                    found[f.key] = f
            except Exception:   # one rule's bug must not silence the others or the stream
                self.rule_errors += 1
                log.exception("diagnosis rule %s failed; the others go on", rule.name)
                found.update({k: t.finding for k, t in self._tracks.items() if k[0] == rule.name})
        return self._step(found, now)

    def _step(self, found: dict[tuple[str, str, str], Finding], now: int) -> list[Event]:
        events = []
        for key, f in found.items():
            t = self._tracks.get(key)
            if t is None:
                t = self._tracks[key] = _Track(now, now, f)
            t.last_ns, t.finding = now, f
            if not t.id and now - t.first_ns >= self.open_after_ns:
                if sum(1 for x in self._tracks.values() if x.id) >= self.max_open:
                    self.refused += 1
                    continue
                t.id, t.opened_ns = uuid.uuid4().hex, now
                self.opened += 1
                log.warning("diagnosis opened: %s %s: %s", f.rule, f.device or "node", _message(f))
                events.append(_event(t, ev.OPEN, now))
        for key, t in list(self._tracks.items()):
            if key in found:
                continue
            if not t.id:
                del self._tracks[key]   # gone before it held for open_after_s: nothing was said
            elif now - t.last_ns >= self.close_after_ns:
                del self._tracks[key]
                self.closed += 1
                log.info("diagnosis closed: %s %s (open %.0f s)", t.finding.rule, t.finding.device or "node",
                         (now - t.opened_ns) / 1e9)
                events.append(_event(t, ev.CLOSED, now))
        return events


def _message(f: Finding) -> str:
    return f"{f.symptom}: {f.cause}; remedy: {f.remedy}"


def _event(t: _Track, state: str, now: int) -> Event:
    f = t.finding
    attrs = {
        ev.ID: t.id, ev.STATE: state, ev.RULE: f.rule, ev.SYMPTOM: f.symptom, ev.CAUSE: f.cause, ev.REMEDY: f.remedy,
        ev.EVIDENCE: json.dumps([e.as_json() for e in f.evidence], separators=(",", ":")),
        ev.OPENED: str(t.opened_ns), **dict(f.attributes),
    }
    msg = _message(f) if state == ev.OPEN else f"resolved: {_message(f)}"
    return Event(ev.TYPE, msg, "warning" if state == ev.OPEN else "info", f.device, attrs, now,
                 f"diag-{t.id}-{state}")
