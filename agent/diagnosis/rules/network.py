"""Network stack trouble: what slows a job's cross-node gradient sync on the host's side of the wire,
the operators' `ethtool -S eth0` check done from the series the agent already holds: TCP
retransmits per cgroup, NIC errors and drops per interface, TCP round-trip time per remote region.
What each reads and when it opens: docs/diagnosis.md "network_stack"."""

from __future__ import annotations

from typing import Any

from xpusense.common import metric_names as m
from xpusense.common.config import Key, positive, ratio

from ..base import NETWORK_STACK, Context, Evidence, Finding, Rule, RuleFamily
from ..jobs import job_cgroups
from ..recent import Recent, Series, counter_rate, covers, histogram_quantile

RETRANSMITS = "xpusense.network.tcp.retransmits"
CGROUP_CALLS = "xpusense.cgroup.network.calls"
DRIVER_ERRORS = "xpusense.network.interface.driver_errors"
NET_ERRORS = "system.network.errors"
NET_DROPPED = "system.network.packet.dropped"
NET_PACKETS = "system.network.packet.count"
DEVICE_PACKETS = "xpusense.network.device.packets"
TCP_RTT = m.NETWORK_TCP_RTT

SYNC_SLOW = "cross-node gradient sync slow"
CLOUD_SYNC_SLOW = "cross-cloud gradient sync slow"
STACK_REMEDY = ("GPUDirect RDMA (collectives over InfiniBand / RoCE, off the kernel's TCP stack); check the NIC "
                "(`ethtool -S`), cabling, the MTU along the path and congestion (switch buffers, ECN)")
MAX_EVIDENCE = 4


def _by(series: list[Series], label: str) -> dict[str, list[Series]]:
    out: dict[str, list[Series]] = {}
    for s in series:
        out.setdefault(s.labels.get(label, ""), []).append(s)
    return out


def _rates(series: list[Series]) -> list[tuple[float, Series]]:
    """(per-second increase, series) of the counters with a rate, the fastest first."""
    got = [(r, s) for s in series if (r := counter_rate(s)) is not None]
    return sorted(got, key=lambda x: -x[0])


def _total(rates: list[tuple[float, Series]]) -> float | None:
    return sum(r for r, _ in rates) if rates else None


class NetworkStack(Rule):
    name = NETWORK_STACK
    reads = (RETRANSMITS, CGROUP_CALLS, DRIVER_ERRORS, NET_ERRORS, NET_DROPPED, NET_PACKETS, DEVICE_PACKETS, TCP_RTT)

    def __init__(self, ctx: Context, window_s: float = 60.0, retransmits_per_s_above: float = 5.0,
                 retransmit_ratio_above: float = 0.01, nic_errors_per_s_above: float = 5.0,
                 nic_error_ratio_above: float = 0.001, rtt_median_above_ms: float = 3.0, rtt_min_samples: int = 10,
                 clear_ratio: float = 0.5):
        self.ctx, self.window_s = ctx, window_s
        self.retrans_per_s, self.retrans_ratio = retransmits_per_s_above, retransmit_ratio_above
        self.nic_per_s, self.nic_ratio = nic_errors_per_s_above, nic_error_ratio_above
        self.rtt_s, self.rtt_min_samples = rtt_median_above_ms / 1e3, rtt_min_samples
        self.clear_ratio = clear_ratio

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        subjects = {subject for _, subject in held}
        return (self._retransmits(recent, now_ns, subjects) + self._nics(recent, now_ns, subjects)
                + self._rtts(recent, now_ns, subjects))

    def _bar(self, threshold: float, is_open: bool) -> float:
        return threshold * self.clear_ratio if is_open else threshold

    # ---------------------------------------------------------------------------------- retransmits

    def _retransmits(self, recent: Recent, now_ns: int, held: set[str]) -> list[Finding]:
        per_cgroup = _by(recent.window(RETRANSMITS, now_ns, self.window_s), "cgroup")
        if not per_cgroup:
            return []
        jobs: dict[str, tuple[str, list[int]]] = {}
        for (device, cgroup), pids in sorted(job_cgroups(self.ctx.processes(), self.ctx.procfs).items()):
            jobs.setdefault(cgroup, (device, sorted(pids)))
        out = []
        for cgroup, series in sorted(per_cgroup.items()):
            is_open = cgroup in held
            if not is_open and not any(covers(s, self.window_s) for s in series):
                continue
            rates = _rates(series)
            rate = _total(rates)
            if rate is None or rate <= self._bar(self.retrans_per_s, is_open):
                continue
            calls = _rates(recent.window(CGROUP_CALLS, now_ns, self.window_s, cgroup=cgroup, direction="transmit")) \
                if cgroup else []
            sends = _total(calls)
            if sends is not None and rate <= self._bar(self.retrans_ratio, is_open) * sends:
                continue
            out.append(self._retransmit_finding(cgroup, jobs.get(cgroup), rates, rate, calls, sends))
        return out

    def _retransmit_finding(self, cgroup: str, job: tuple[str, list[int]] | None, rates: list[tuple[float, Series]],
                            rate: float, calls: list[tuple[float, Series]], sends: float | None) -> Finding:
        per_call = f", {rate / sends:.2f} per send call ({sends:.1f} sends/s)" if sends else ""
        evidence = [Evidence.of(s, self.window_s, f"{r:.2f} retransmitted segments/s over {s.span_s:.0f} s "
                                                  f"(threshold {self.retrans_per_s:g}/s)") for r, s in rates[:MAX_EVIDENCE]]
        evidence += [Evidence.of(s, self.window_s, f"{r:.2f} send calls/s over {s.span_s:.0f} s; retransmits per call "
                                                   f"{rate / sends:.3f} (threshold {self.retrans_ratio:g})")
                     for r, s in calls[:1] if sends]
        where = f"cgroup {cgroup}" if cgroup else "the node (this kernel's netio counts retransmits per family only)"
        cause = f"TCP retransmitting {rate:.1f} segments/s{per_call} in {where}"
        attrs = {"cgroup": cgroup} if cgroup else {}
        device = ""
        if job is not None:
            device, pids = job
            cause += f"; processes {', '.join(str(p) for p in pids[:5])} on {device}"
            attrs["process.pid"] = str(pids[0])
        return Finding(self.name, device, SYNC_SLOW, cause, STACK_REMEDY, tuple(evidence), subject=cgroup,
                       attributes=attrs)

    # ---------------------------------------------------------------------------------- NIC errors

    def _nics(self, recent: Recent, now_ns: int, held: set[str]) -> list[Finding]:
        kernel = _by(recent.window(NET_ERRORS, now_ns, self.window_s)
                     + recent.window(NET_DROPPED, now_ns, self.window_s), "device")
        driver = _by(recent.window(DRIVER_ERRORS, now_ns, self.window_s), "device")
        packets = _by(recent.window(NET_PACKETS, now_ns, self.window_s), "device")
        fallback = _by(recent.window(DEVICE_PACKETS, now_ns, self.window_s), "device")
        out = []
        for dev in sorted(set(kernel) | set(driver)):
            is_open = dev in held
            series = kernel.get(dev, []) + driver.get(dev, [])
            if not dev or (not is_open and not any(covers(s, self.window_s) for s in series)):
                continue
            k, d = _rates(kernel.get(dev, [])), _rates(driver.get(dev, []))
            rate = max(_total(k) or 0.0, _total(d) or 0.0)
            if rate <= self._bar(self.nic_per_s, is_open):
                continue
            pk = _rates(packets.get(dev) or fallback.get(dev, []))
            moved = _total(pk)
            if moved is not None and rate <= self._bar(self.nic_ratio, is_open) * moved:
                continue
            out.append(self._nic_finding(dev, sorted(k + d, key=lambda x: -x[0]), rate, pk, moved))
        return out

    def _nic_finding(self, dev: str, rates: list[tuple[float, Series]], rate: float,
                     packets: list[tuple[float, Series]], moved: float | None) -> Finding:
        def name(s: Series) -> str:
            return s.labels.get("counter") or f"{s.name.rsplit('.', 1)[-1]} {s.labels.get('direction', '')}".strip()
        rising = [(r, s) for r, s in rates if r > 0 and r >= rate * 0.01]   # the counters that matter
        evidence = [Evidence.of(s, self.window_s, f"{name(s)} rising {r:.2f}/s over {s.span_s:.0f} s "
                                                  f"(threshold {self.nic_per_s:g}/s for the interface)")
                    for r, s in rising[:MAX_EVIDENCE]]
        share = ""
        if moved:
            share = f" ({rate / moved:.2%} of its {moved:.0f} packets/s)"
            evidence += [Evidence.of(s, self.window_s, f"{r:.1f} packets/s; errors and drops {rate / moved:.3%} of "
                                                       f"them (threshold {self.nic_ratio:.3%})") for r, s in packets[:2]]
        counters = ", ".join(f"{name(s)} {r:.1f}/s" for r, s in rising[:3])
        return Finding(self.name, "", SYNC_SLOW,
                       f"interface {dev} losing {rate:.1f} packets/s to errors and drops{share}: {counters}",
                       STACK_REMEDY, tuple(evidence), subject=dev, attributes={"network.interface.name": dev})

    # ---------------------------------------------------------------------------------- round-trip time

    def _rtts(self, recent: Recent, now_ns: int, held: set[str]) -> list[Finding]:
        out = []
        for s in recent.window(TCP_RTT, now_ns, self.window_s):
            region = s.labels.get("remote_region", "")
            is_open = region in held
            if not is_open and not covers(s, self.window_s):
                continue
            got = histogram_quantile(s, 0.5)
            if got is None or got[1] < self.rtt_min_samples or got[0] <= self._bar(self.rtt_s, is_open):
                continue
            out.append(self._rtt_finding(region, s, *got))
        return out

    def _rtt_finding(self, region: str, s: Series, median: float, n: int) -> Finding:
        shown = f"{median * 1e3:.1f} ms"
        first, last = s.points[0], s.points[-1]
        mean = (last.value - (first.value if len(s.points) > 1 else 0.0)) / n
        threshold = f"{self.rtt_s * 1e3:g} ms"
        evidence = (Evidence.of(s, self.window_s, f"median {shown} (mean {mean * 1e3:.1f} ms) over {n} RTT samples in "
                                                  f"{s.span_s:.0f} s (threshold {threshold})"),)
        return Finding(self.name, "", CLOUD_SYNC_SLOW,
                       f"TCP round-trip time to region {region} median {shown} over {n} samples (above {threshold})",
                       f"past {threshold} between clouds pick larger microbatches (gradient accumulation: fewer "
                       "syncs per sample); GPUDirect RDMA for the network stack's overhead",
                       evidence, subject=region, attributes={"network.remote_region": region})


def build(section: Any, ctx: Context) -> Rule | None:
    return NetworkStack(ctx, float(section.window_s), float(section.retransmits_per_s_above),
                        float(section.retransmit_ratio_above), float(section.nic_errors_per_s_above),
                        float(section.nic_error_ratio_above), float(section.rtt_median_above_ms),
                        int(section.rtt_min_samples), float(section.clear_ratio))


FAMILY = RuleFamily(NETWORK_STACK, {
    "enabled": Key(bool, True),
    "window_s": Key((int, float), 60.0, positive, help="each figure is judged over this long"),
    "retransmits_per_s_above": Key((int, float), 5.0, positive, help="TCP retransmitted segments/s of a cgroup above "
                                                                     "this opens the diagnosis..."),
    "retransmit_ratio_above": Key((int, float), 0.01, positive, help="...when also above this many per send call of "
                                                                     "the cgroup (where netio counts its sends)"),
    "nic_errors_per_s_above": Key((int, float), 5.0, positive, help="an interface's errors + drops per s above this "
                                                                    "opens the diagnosis..."),
    "nic_error_ratio_above": Key((int, float), 0.001, ratio, help="...when also above this share of its packets "
                                                                  "(where they are counted)"),
    "rtt_median_above_ms": Key((int, float), 3.0, positive, help="median TCP round-trip time to a remote region above "
                                                                 "this opens the diagnosis"),
    "rtt_min_samples": Key(int, 10, positive, help="RTT samples a window needs before its median counts"),
    "clear_ratio": Key((int, float), 0.5, ratio, help="an open diagnosis closes once its figure is at or below this "
                                                      "share of the threshold that opened it"),
}, build)
