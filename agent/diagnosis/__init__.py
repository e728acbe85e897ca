"""Diagnosis: the node's recent signals turned into findings that name a cause (docs/diagnosis.md).

recent.py keeps the series rules read; base.py is the contract a rule implements (Finding,
Evidence, Rule, RuleFamily); engine.py opens and closes diagnoses with hysteresis and makes the
`diagnosis` events the stream carries; rules/ holds one module per rule, registry.py lists them.
"""
