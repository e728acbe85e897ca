"""tc_traffic: SCHED_CLS programs on clsact's ingress and egress hooks, added and removed over rtnetlink.

Our filters carry a name, priority and handle of their own (specs.TC_FILTER_*), so a restarted agent
finds and removes the ones a crashed run left behind, on any interface of the namespace, without
touching anyone else's. A clsact qdisc we added is removed again when no filter is left on it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from xpusense.probes import specs

from ..base import Unavailable
from .loader import EbpfLoader, Plan
from .procfs import physical_links
from .source import EbpfSource

log = logging.getLogger("xpusense.agent.sources.ebpf")

TC_PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}   # clsact's ingress and egress hooks
DIRECTIONS_TC = ("receive", "transmit")
IFF_LOOPBACK = 0x8
EEXIST = 17


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
        self._created_clsact: set[int] = set()
        self.stale_removed = 0

    def _ipr(self) -> Any:
        from pyroute2 import IPRoute
        if self.netns:
            path = self.netns if "/" in self.netns else os.path.join("/run/netns", self.netns)
            if not os.path.exists(path):   # pyroute2 would create it
                raise Unavailable(f"tc_traffic: network namespace {self.netns!r} does not exist (no {path}); "
                                  f"fix [sources.ebpf] tc_netns")
            return IPRoute(netns=self.netns)
        return IPRoute()

    def plan_extra(self, plan: Plan) -> None:
        try:
            ipr = self._ipr()
        except Unavailable:
            raise
        except Exception as e:
            raise Unavailable(f"tc_traffic: cannot open rtnetlink: {e}") from e
        try:
            links = []
            for m in ipr.get_links():
                info = m.get_attr("IFLA_LINKINFO")
                links.append({"ifname": m.get_attr("IFLA_IFNAME"), "index": m["index"],
                              "kind": info.get_attr("IFLA_INFO_KIND") if info is not None else None,
                              "loopback": bool(m["flags"] & IFF_LOOPBACK)})
        finally:
            ipr.close()
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

    def attach(self) -> None:
        from pyroute2.netlink.exceptions import NetlinkError
        fns = {d: self._load(fn, "SCHED_CLS") for d, fn in
               (("ingress", specs.TC_INGRESS_FN), ("egress", specs.TC_EGRESS_FN))}
        plan = self.planned
        self.ifaces = dict(plan.extra["interfaces"])
        ipr = self._ipr()
        try:
            # Filters a crashed run left behind, on any interface of the namespace (the configured
            # list may have changed since): found by our name/priority, removed before adding ours.
            for idx in plan.extra.get("all_ifindexes", self.ifaces):
                self.stale_removed += self._remove_ours(ipr, idx)
            for idx, ifname in self.ifaces.items():
                try:
                    ipr.tc("add", "clsact", idx)
                    self._created_clsact.add(idx)
                except NetlinkError as e:
                    if e.code != EEXIST:   # someone (maybe we, before a crash) added it already
                        raise Unavailable(f"tc_traffic: cannot add a clsact qdisc to {ifname}: {e}") from e
                for direction, fn in fns.items():
                    try:
                        ipr.tc("add-filter", "bpf", idx, specs.TC_FILTER_HANDLE, fd=fn.fd,
                               name=f"{specs.TC_FILTER_NAME}", parent=TC_PARENTS[direction], classid=1,
                               direct_action=True, prio=specs.TC_FILTER_PRIO)
                    except NetlinkError as e:
                        raise Unavailable(f"tc_traffic: cannot attach the {direction} filter to {ifname}: {e}") from e
                    self._attached.append(("tc", f"{ifname} {direction}"))
        finally:
            ipr.close()
        if self.stale_removed:
            log.warning("tc_traffic: removed %d stale filter(s) left by an earlier run", self.stale_removed)

    @staticmethod
    def _remove_ours(ipr: Any, idx: int) -> int:
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

    def detach(self) -> None:
        if not self._attached and not self._created_clsact:
            return
        try:
            ipr = self._ipr()
        except Exception:
            log.warning("tc_traffic: cannot open rtnetlink to detach; the next start removes the filters")
            return
        try:
            for idx in self.ifaces:
                self._remove_ours(ipr, idx)
                if idx in self._created_clsact:
                    others = [m for p in TC_PARENTS.values() for m in ipr.get_filters(index=idx, parent=p)]
                    if not others:
                        try:
                            ipr.tc("del", "clsact", idx)
                        except Exception:
                            pass
        finally:
            ipr.close()
        self._attached.clear()
        self._created_clsact.clear()

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
