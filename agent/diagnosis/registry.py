"""Every diagnosis rule the agent runs; adding one means writing its module under rules/ and adding
it here. The agent's config schema ([diagnosis.NAME]) and the daemon loop over this list."""

from __future__ import annotations

from .base import Context, RuleFamily
from .engine import Diagnoser
from .rules.clocks import FAMILY as CLOCKS
from .rules.cpu_starvation import FAMILY as CPU_STARVATION
from .rules.memory import FAMILY as MEMORY
from .rules.network import FAMILY as NETWORK
from .rules.numa import FAMILY as NUMA
from .rules.pcie import FAMILY as PCIE

FAMILIES: tuple[RuleFamily, ...] = (MEMORY, CLOCKS, CPU_STARVATION, PCIE, NUMA, NETWORK)


def build_diagnoser(section, ctx: Context) -> Diagnoser | None:
    """The `[diagnosis]` table -> the engine with every enabled rule (None when diagnosis is off)."""
    if not section.enabled:
        return None
    rules = []
    for family in FAMILIES:
        table = getattr(section, family.name)
        if table.enabled and (rule := family.build(table, ctx)) is not None:
            rules.append(rule)
    return Diagnoser(rules, open_after_s=float(section.open_after_s), close_after_s=float(section.close_after_s),
                     check_every_s=float(section.check_every_s), keep_s=float(section.keep_s),
                     max_open=int(section.max_open))
