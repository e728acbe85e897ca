"""tc_traffic: SCHED_CLS programs on clsact's ingress and egress hooks, added and removed over rtnetlink.

Our filters carry a name, priority and handle of their own (specs.TC_FILTER_*), so a restarted agent
finds and removes the ones a crashed run left behind, on any interface of the namespace, without
touching anyone else's. A clsact qdisc we added is removed again when no filter is left on it.
The loader process adds the filters (`attach_filters`, with the programs' fds it just loaded); the
kernel holds the programs from then on, and the agent's source removes the filters on close.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from xpusense.probes import specs

from ..base import Unavailable
from .links import LinksError, list_links, netns_path
from .loader import EbpfLoader, Plan
from .procfs import physical_links
from .source import EbpfSource

log = logging.getLogger("xpusense.agent.sources.ebpf")

TC_PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}   # clsact's ingress and egress hooks
DIRECTIONS_TC = ("receive", "transmit")
EEXIST = 17


def open_ipr(netns: str) -> Any:
    """An IPRoute in `netns` (a name under /run/netns or a path; "" for our own)."""
    from pyroute2 import IPRoute
    if netns:
        path = netns_path(netns)
        if not os.path.exists(path):   # pyroute2 would create it
            raise Unavailable(f"tc_traffic: network namespace {netns!r} does not exist (no {path}); "
                              f"fix [sources.ebpf] tc_netns")
        return IPRoute(netns=netns)
    return IPRoute()


def remove_ours(ipr: Any, idx: int) -> int:
    """Delete our filters (by name or priority) from both clsact hooks of ifindex `idx`; how many."""
    removed = 0
    for parent in TC_PARENTS.values():
        try:
            msgs = list(ipr.get_filters(index=idx, parent=parent))
        except Exception:
            continue
        prios = {(m["info"] >> 16) & 0xFFFF for m in msgs if ours(m) and m["handle"]}
        for prio in prios:
            try:
                ipr.tc("del-filter", "bpf", idx, 0, parent=parent, prio=prio)
                removed += 1
            except Exception:
                log.debug("tc_traffic: deleting filter prio %d on ifindex %d failed", prio, idx, exc_info=True)
    return removed


def prepare_filters(spec: dict) -> tuple[dict, Any]:
    """In the loader process, while the programs compile: stale filters removed and clsact added on
    every interface of spec["interfaces"] ({ifindex: name}). Returns (what was done, the open IPRoute
    for add_filters, or None when "error" says why it stopped)."""
    from pyroute2.netlink.exceptions import NetlinkError
    done: dict[str, Any] = {"netns": spec["netns"], "ifaces": spec["interfaces"], "attached": [],
                            "created_clsact": [], "stale_removed": 0, "error": ""}
    try:
        ipr = open_ipr(spec["netns"])
    except Unavailable as e:
        done["error"] = str(e)
        return done, None
    try:
        # Filters a crashed run left behind, on any interface of the namespace (the configured list may
        # have changed since): found by our name/priority, removed before adding ours.
        for idx in spec.get("all_ifindexes") or [int(i) for i in spec["interfaces"]]:
            done["stale_removed"] += remove_ours(ipr, idx)
        for sidx, ifname in spec["interfaces"].items():
            try:
                ipr.tc("add", "clsact", int(sidx))
                done["created_clsact"].append(int(sidx))
            except NetlinkError as e:
                if e.code != EEXIST:   # someone (maybe we, before a crash) added it already
                    done["error"] = f"tc_traffic: cannot add a clsact qdisc to {ifname}: {e}"
                    break
    except Exception as e:
        done["error"] = f"tc_traffic: rtnetlink failed: {type(e).__name__}: {e}"
    if done["error"]:
        ipr.close()
        return done, None
    return done, ipr


def add_filters(done: dict, ipr: Any, fds: dict[str, int]) -> dict:
    """Our ingress and egress filters (the programs' fds) on every prepared interface; closes `ipr`.
    "error" in the result says why it stopped (what it had added is listed, for detach_filters)."""
    from pyroute2.netlink.exceptions import NetlinkError
    try:
        for sidx, ifname in done["ifaces"].items():
            for direction, fd in fds.items():
                try:
                    ipr.tc("add-filter", "bpf", int(sidx), specs.TC_FILTER_HANDLE, fd=fd, name=specs.TC_FILTER_NAME,
                           parent=TC_PARENTS[direction], classid=1, direct_action=True, prio=specs.TC_FILTER_PRIO)
                except NetlinkError as e:
                    done["error"] = f"tc_traffic: cannot attach the {direction} filter to {ifname}: {e}"
                    return done
                done["attached"].append(f"{ifname} {direction}")
    finally:
        ipr.close()
    return done


def attach_filters(spec: dict, fds: dict[str, int]) -> dict:
    """prepare_filters then add_filters: what was done ("error": why it stopped)."""
    done, ipr = prepare_filters(spec)
    return done if ipr is None else add_filters(done, ipr, fds)


def detach_filters(done: dict) -> None:
    """Our filters off every interface attach_filters worked on, and the clsact qdiscs it added when
    no filter is left on them."""
    try:
        ipr = open_ipr(done["netns"])
    except Exception:
        log.warning("tc_traffic: cannot open rtnetlink to detach; the next start removes the filters")
        return
    created = set(done.get("created_clsact", []))
    try:
        for sidx in done["ifaces"]:
            idx = int(sidx)
            remove_ours(ipr, idx)
            if idx in created:
                others = [m for p in TC_PARENTS.values() for m in ipr.get_filters(index=idx, parent=p)]
                if not others:
                    try:
                        ipr.tc("del", "clsact", idx)
                    except Exception:
                        pass
    finally:
        ipr.close()


def ours(filter_msg: Any) -> bool:
    """A tc filter message that one of our runs added (by name or by our priority)."""
    if filter_msg.get_attr("TCA_KIND") != "bpf":
        return False
    opts = filter_msg.get_attr("TCA_OPTIONS")
    name = opts.get_attr("TCA_BPF_NAME") if opts is not None else None
    prio = (filter_msg["info"] >> 16) & 0xFFFF
    return (name or "").startswith(specs.TC_FILTER_NAME) or prio == specs.TC_FILTER_PRIO


class TcTrafficSource(EbpfSource):
    probe = "tc_traffic"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.netns: str = self.cfg.tc_netns
        self.ifaces: dict[int, str] = {}
        self.stale_removed = 0
        self._done: dict | None = None     # what the loader's attach_filters did, for detach

    def plan_extra(self, plan: Plan) -> None:
        if self.netns and not os.path.exists(path := netns_path(self.netns)):
            raise Unavailable(f"tc_traffic: network namespace {self.netns!r} does not exist (no {path}); "
                              f"fix [sources.ebpf] tc_netns")
        try:
            links = list_links(self.netns)      # one rtnetlink dump, without importing pyroute2 here
        except LinksError as e:
            raise Unavailable(f"tc_traffic: cannot list the interfaces over rtnetlink: {e}") from e
        by_name = {link["ifname"]: link["index"] for link in links}
        wanted = list(self.cfg.tc_interfaces or [])
        where = f"network namespace {self.netns!r}" if self.netns else "this host"
        if wanted:
            missing = [n for n in wanted if n not in by_name]
            if missing:
                raise Unavailable(f"tc_traffic: no interface {', '.join(missing)} in {where} "
                                  f"(have {', '.join(sorted(by_name))}); fix [sources.ebpf] tc_interfaces")
        else:
            wanted = physical_links(links)
            if not wanted:
                raise Unavailable(f"tc_traffic: no physical interfaces in {where}; list the ones to count in "
                                  f"[sources.ebpf] tc_interfaces")
        plan.extra["interfaces"] = {by_name[n]: n for n in wanted}
        plan.extra["all_ifindexes"] = sorted(by_name.values())
        plan.attach["tc"] = {"netns": self.netns, "interfaces": {str(i): n for i, n in plan.extra["interfaces"].items()},
                             "all_ifindexes": plan.extra["all_ifindexes"], "ingress_fn": specs.TC_INGRESS_FN,
                             "egress_fn": specs.TC_EGRESS_FN}

    def after_attach(self) -> None:
        assert self.handle is not None
        self._done = dict(self.handle.extra, attached=[t for _k, t in self.handle.attached])
        self.ifaces = {int(i): n for i, n in self._done["ifaces"].items()}
        self.stale_removed = int(self._done.get("stale_removed", 0))
        if self.stale_removed:
            log.warning("tc_traffic: removed %d stale filter(s) left by an earlier run", self.stale_removed)

    def detach(self) -> None:
        if self._done is not None:
            detach_filters(self._done)
            self._done = None

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        if decoder == "iface":
            d = int(key.dir)
            return {"device": self.ifaces.get(int(key.ifindex), str(int(key.ifindex))),
                    "direction": DIRECTIONS_TC[d] if d < 2 else str(d)}
        return super().key_labels(decoder, key, value)

    def describe(self) -> dict:
        d = super().describe()
        d["netns"] = self.netns or "(agent's)"
        if self.ifaces:
            d["interfaces"] = sorted(self.ifaces.values())
        d["filter"] = {"name": specs.TC_FILTER_NAME, "prio": specs.TC_FILTER_PRIO,
                       "handle": hex(specs.TC_FILTER_HANDLE)}
        if self.stale_removed:
            d["stale_filters_removed"] = self.stale_removed
        return d
