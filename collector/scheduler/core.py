"""The scheduler core: Scheduler(fleet, section, stale_s) follows the fleet (fleet.py) with the loaded
[scheduler] config section; place(request) decides (search.py) and answers with the ranking and its
reasons (explain.py); judge(request, nodes) gives a verdict per named node (verdicts.py), replies
the extender's answers over a list of names from them (extender_replies.py), anew or kept per
request shape (verdict_cache.py)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, TypeVar

from xpusense.v1 import scheduler_pb2 as spb

from ..fleet_interface import Fleet
from .config import PlaceError, Settings, resolve_weights
from .explain import fill_reply
from .extender_replies import Replies, fleet_ids
from .fleet import FleetView
from .index import CMAX, TYPE_INDEX
from .search import Query, scan, search
from .verdict_cache import VerdictCache
from .verdicts import Verdict, judge

T = TypeVar("T")


class Scheduler:
    """The core. Construct it on the loop thread that owns `state`; it registers itself as a watcher.
    `section`: the loaded (and checked) [scheduler] table of the collector's config; `stale_s`:
    the collector's, after which a silent node is left out."""

    def __init__(self, state: Fleet, section: Any, stale_s: float, refresh_ms: float | None = None):
        self.settings = Settings.from_section(section, stale_s)
        self.weights = self.settings.weights
        # How old the index may be (fleet.py): [scheduler] index_refresh_ms unless given.
        if refresh_ms is None:
            refresh_ms = float(getattr(section, "index_refresh_ms", 0.0))
        self.view = FleetView(state, self.settings, refresh_ms)
        self.state = state

    def place(self, req: spb.PlaceRequest, scan: bool = False) -> spb.PlaceReply:
        """Rank the fleet for one request. Runs on the loop thread that owns the state, in one go.
        `scan`: walk every node (the reference the indexed search is tested against).

        The cyclic garbage collector is held off while deciding: a collection that falls due (the
        fleet state's history grows by tens of thousands of objects a second) then runs at the next
        allocation after the decision, on the ingest path, instead of adding milliseconds here."""
        return _without_gc(lambda: self._place(req, scan))

    def judge(self, req: spb.PlaceRequest, node_ids: list[str]) -> list[Verdict]:
        """Whether each of the named nodes can take the request, with its score (as Place ranks it)
        or the reason it cannot (verdicts.py). On the loop thread that owns the state, in one go."""
        return _without_gc(lambda: judge(self.view, self._query(req)[0], node_ids))

    def replies(self, req: spb.PlaceRequest, names: list[str], cache: VerdictCache | None = None) -> Replies:
        """The extender's replies over Kubernetes node `names` (extender_replies.py): kept in `cache`
        per request shape and list of names, else judged anew."""
        def made() -> Replies:
            q, view = self._query(req)[0], self.view
            if cache is not None:
                return cache.replies(view, q, names)
            ids = fleet_ids(view.k8s_nodes, names)
            return Replies(names, ids, judge(view, q, ids), view.k8s_changes)
        return _without_gc(made)

    def _query(self, req: spb.PlaceRequest) -> tuple[Query, dict[str, float]]:
        """The request checked and made a Query, with the index caught up to now."""
        weights = self.weights if not req.HasField("weights") else resolve_weights(self.weights, req.weights)
        if req.residency == spb.RESIDENCY_REGION and not req.data_region:
            raise PlaceError("residency REGION needs the data region (data_region, --data-region)")
        if req.residency == spb.RESIDENCY_PROVINCE and not req.data_province:
            raise PlaceError("residency PROVINCE needs the data province (data_province, --data-province)")
        type_index = TYPE_INDEX.get(req.accelerator)
        if type_index is None:
            raise PlaceError(f"unknown accelerator type {req.accelerator}")
        view = self.view
        view.catch_up()   # nothing older than the index's bound is left out
        now = self.state.clock()
        if view.expiries and view.expiries[0][0] <= now:
            view.expire(now)
        view.latency.expire(now)   # measured figures past measured_latency_max_age_s (those due only)
        q = Query(req, weights, type_index, now, self.settings.stale_ns, self.settings.regions, view.latency)
        return q, weights

    def _place(self, req: spb.PlaceRequest, full_scan: bool) -> spb.PlaceReply:
        t0 = time.perf_counter_ns()
        q, weights = self._query(req)
        view, now = self.view, q.now
        if full_scan or q.count > CMAX:
            scan(view, q)
        else:
            search(view, q)
        reply = spb.PlaceReply(nodes_total=len(view.summaries), nodes_feasible=q.feasible, time_unix_nano=now)
        rw = reply.weights
        rw.compute, rw.data_affinity, rw.disaster_tolerance, rw.compliance = (
            q.w_compute, q.w_data, q.w_dr, q.w_compliance)
        fill_reply(view, q, reply, weights)
        reply.decision_us = (time.perf_counter_ns() - t0) / 1e3
        return reply


def _without_gc(decide: Callable[[], T]) -> T:
    """decide() with the cyclic garbage collector held off (see Scheduler.place)."""
    if not gc.isenabled():
        return decide()
    gc.disable()
    try:
        return decide()
    finally:
        gc.enable()
