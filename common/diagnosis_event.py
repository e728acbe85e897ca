"""The `diagnosis` event's contract (docs/diagnosis.md "The event"): its type and attribute names,
written by the agent's engine (agent/diagnosis/engine.py) and read by the collector
(collector/diagnoses.py and its readers)."""

from __future__ import annotations

TYPE = "diagnosis"
ID, STATE, RULE = "diagnosis.id", "diagnosis.state", "diagnosis.rule"
SYMPTOM, CAUSE, REMEDY = "diagnosis.symptom", "diagnosis.cause", "diagnosis.remedy"
EVIDENCE, OPENED = "diagnosis.evidence", "diagnosis.opened_unix_nano"
OPEN, CLOSED = "open", "closed"
