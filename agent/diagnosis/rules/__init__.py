"""One module per diagnosis rule, each exporting FAMILY (agent/diagnosis/base.py RuleFamily)."""
