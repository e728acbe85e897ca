"""tcp_rtt: the kernel's per-remote-address RTT histograms (probes/tcp_rtt.bpf.c), summed per remote
region of the CIDR table `[sources.ebpf.tcp_rtt] regions` into `xpusense.network.tcp.rtt{remote_region}`.
Each address's change since the last read is added to its region, so deleting idle entries from the
bounded map (at each nearline round) keeps their share; docs/ebpf.md says what can be lost.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from .loader import EbpfLoader
from .source import EbpfSource

OTHER_REGION = "other"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_regions(table: dict[str, str]) -> list[tuple[Network, str]]:
    """{"10.20.0.0/16": "cn-north-1", ...} -> [(network, region)], longest prefix first; ValueError
    naming the first entry that is not a network or has an empty region."""
    out: list[tuple[Network, str]] = []
    for cidr, region in table.items():
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValueError(f"has {cidr!r}, which is not an IPv4 or IPv6 network (e.g. \"10.20.0.0/16\")") from None
        if not region:
            raise ValueError(f"gives {cidr!r} an empty region")
        out.append((net, region))
    out.sort(key=lambda nr: -nr[0].prefixlen)
    return out


def regions_check(table: dict[str, str]) -> str | None:
    try:
        parse_regions(table)
    except ValueError as e:
        return str(e)
    return None


def address_of(raw: bytes) -> Address:
    """The probe's 16-byte key (IPv6, IPv4 as ::ffff:a.b.c.d) -> an address."""
    v6 = ipaddress.IPv6Address(bytes(raw))
    return v6.ipv4_mapped or v6


def region_of(addr: Address, regions: list[tuple[Network, str]]) -> str:
    for net, region in regions:
        if addr.version == net.version and addr in net:
            return region
    return OTHER_REGION


class _Hist:
    """A region's cumulative histogram, shaped like a map value (slots, sum_ns) for read_maps."""

    def __init__(self, n: int):
        self.slots = [0] * n
        self.sum_ns = 0


class TcpRttSource(EbpfSource):
    probe = "tcp_rtt"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.regions = parse_regions(dict(self.cfg.tcp_rtt.regions))
        self._last: dict[bytes, tuple[tuple[int, ...], int]] = {}     # address key -> (slots, sum_ns) read
        self._totals: dict[str, _Hist] = {}
        self.deleted_idle = 0

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        if decoder == "total":
            return {}
        return super().key_labels(decoder, key, value)

    def entries(self, decoder: str, table: Any) -> list[tuple[Any, Any, dict]]:
        if decoder != "remote":
            return super().entries(decoder, table)
        idle = []
        for key, value in table.items():
            raw = bytes(key.addr)
            slots, sum_ns = tuple(int(x) for x in value.slots), int(value.sum_ns)
            before = self._last.get(raw)
            if before == (slots, sum_ns):
                idle.append(key)
                continue
            prev_slots, prev_sum = before or ((0,) * len(slots), 0)
            region = region_of(address_of(raw), self.regions)
            hist = self._totals.setdefault(region, _Hist(len(slots)))
            for i, (now, was) in enumerate(zip(slots, prev_slots)):
                hist.slots[i] += now - was
            hist.sum_ns += sum_ns - prev_sum
            self._last[raw] = (slots, sum_ns)
        for key in idle:
            try:
                del table[key]
            except KeyError:
                pass
            self._last.pop(bytes(key.addr), None)
        self.deleted_idle += len(idle)
        return [(None, hist, {"remote_region": region}) for region, hist in sorted(self._totals.items())]

    def forget_dead(self, decoder: str, table: Any, entries: list[tuple[Any, Any, dict]]) -> None:
        if decoder != "remote":         # entries() already deleted the idle addresses
            super().forget_dead(decoder, table, entries)

    def describe(self) -> dict:
        return {**super().describe(), "regions": {str(n): r for n, r in self.regions},
                "addresses_tracked": len(self._last), "idle_addresses_deleted": self.deleted_idle}
