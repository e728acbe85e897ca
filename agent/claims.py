"""A collector's claims to have stored batches, checked against what this agent sent.

A Welcome's `stored_up_to` and an Ack each say that a collector holds batches of one agent boot up
to a sequence number; neither can be above the highest one this agent gave a batch of that boot
(this boot's from the stream; an earlier boot's from the spool); nor can a Welcome's
`series_defined_up_to` be above the highest series_ref the agent defined. A collector that claims more was
forged or lost its state: its claim takes nothing as acknowledged; it is logged and counted, and
the stream ends the connection (ImpossibleClaim), so that every unacknowledged batch goes again."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc

log = logging.getLogger("xpusense.agent.stream")


class ImpossibleClaim(grpc.RpcError):
    """Raised while reading a connection's replies: it ends like one the collector failed."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return self.why


class Claims:
    def __init__(self) -> None:
        self.earlier: dict[str, int] = {}   # earlier boots (from the spool): the highest seq they used
        self.impossible = 0                 # Welcomes and acks claiming more than was sent
        self._said: tuple[str, str, str, int] | None = None

    def spooled(self, keys: Iterable[tuple[str, int]], marks: dict[str, int]) -> None:
        """The batches of earlier boots handed back by the spool, and its acknowledged marks."""
        for boot, seq in [*keys, *marks.items()]:
            self.earlier[boot] = max(seq, self.earlier.get(boot, 0))

    def impossible_claim(self, address: str, what: str, boot: str, claimed: int,
                         current: tuple[str, int]) -> str | None:
        """None when a collector's claim to hold `boot` up to `claimed` can be true (`current`: this
        boot and the highest seq it used so far); else why not (logged once per collector, boot and
        claim, and counted every time)."""
        highest = max(current[1] if boot == current[0] else 0, self.earlier.get(boot, 0))
        if claimed <= highest:
            return None
        return self._impossible(address, what, boot, claimed, f"collector {address} claims in its {what} to hold "
                                f"batches of boot {boot} up to seq {claimed}, but this agent sent only up to {highest}")

    def impossible_definitions(self, address: str, boot: str, claimed: int, defined: int) -> str | None:
        """None when a Welcome's claim to hold the series definitions of `boot` up to series_ref
        `claimed` can be true (`defined`: the highest this agent defined in that boot); else why not."""
        if claimed <= defined:
            return None
        return self._impossible(address, "Welcome's definitions", boot, claimed,
                                f"collector {address} claims in its Welcome to hold the series definitions of boot "
                                f"{boot} up to series_ref {claimed}, but this agent defined only up to {defined}")

    def _impossible(self, address: str, what: str, boot: str, claimed: int, why: str) -> str:
        self.impossible += 1
        if self._said != (address, what, boot, claimed) or self.impossible % 100 == 0:
            self._said = (address, what, boot, claimed)
            log.warning("%s: forged, or it lost its state; nothing taken as acknowledged, every unacknowledged "
                        "batch is kept and sent again (to the next collector, if there are several); %d such "
                        "claims so far", why, self.impossible)
        return why
