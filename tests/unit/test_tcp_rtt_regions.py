"""tcp_rtt's user side without root: the CIDR table, and per-address histograms summed per region."""

from __future__ import annotations

import ipaddress
from types import SimpleNamespace

import pytest

from xpusense.agent.sources.ebpf import family
from xpusense.agent.sources.ebpf.tcp_rtt import OTHER_REGION, TcpRttSource, address_of, parse_regions, region_of
from xpusense.common.config import ConfigError


def test_longest_prefix_wins_and_unmatched_is_other():
    regions = parse_regions({"10.0.0.0/8": "wide", "10.20.0.0/16": "cn-north-1", "fd00::/8": "v6"})
    assert region_of(ipaddress.ip_address("10.20.3.4"), regions) == "cn-north-1"
    assert region_of(ipaddress.ip_address("10.21.3.4"), regions) == "wide"
    assert region_of(ipaddress.ip_address("fd00::1"), regions) == "v6"
    assert region_of(ipaddress.ip_address("192.0.2.1"), regions) == OTHER_REGION


def test_a_bad_network_in_the_table_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"sources\.ebpf\.tcp_rtt\.regions.*'10\.0\.0/33'"):
        family.table_from({"tcp_rtt": {"regions": {"10.0.0/33": "x"}}})
    with pytest.raises(ConfigError, match="empty region"):
        family.table_from({"tcp_rtt": {"regions": {"10.0.0.0/8": ""}}})


def test_ipv4_mapped_keys_are_ipv4_addresses():
    raw = bytes(10) + b"\xff\xff" + bytes([10, 20, 0, 7])
    assert address_of(raw) == ipaddress.IPv4Address("10.20.0.7")
    assert address_of(ipaddress.IPv6Address("fd00::5").packed) == ipaddress.IPv6Address("fd00::5")


class FakeTable(dict):
    """A map as bpfmap presents it: items() of (key with .addr, value with .slots and .sum_ns)."""

    def put(self, addr: str, slots: list[int], sum_ns: int):
        a = ipaddress.ip_address(addr)
        raw = (bytes(10) + b"\xff\xff" + a.packed) if a.version == 4 else a.packed
        self[raw] = SimpleNamespace(slots=slots, sum_ns=sum_ns)

    def items(self):
        return [(SimpleNamespace(addr=k), v) for k, v in super().items()]

    def __delitem__(self, key):
        super().__delitem__(key.addr if hasattr(key, "addr") else key)


def source(regions):
    src = TcpRttSource.__new__(TcpRttSource)       # the user side only: no loader
    src.regions = parse_regions(regions)
    src._last, src._totals, src.deleted_idle = {}, {}, 0
    return src


def test_regions_sum_their_addresses_and_keep_a_deleted_idle_address_share():
    src = source({"10.20.0.0/16": "cn-north-1"})
    t = FakeTable()
    t.put("10.20.0.1", [0, 2, 1], 300)
    t.put("10.20.0.2", [0, 1, 0], 100)
    t.put("192.0.2.9", [0, 0, 4], 4000)
    got = {lab["remote_region"]: (list(h.slots), h.sum_ns) for _k, h, lab in src.entries("remote", t)}
    assert got == {"cn-north-1": ([0, 3, 1], 400), OTHER_REGION: ([0, 0, 4], 4000)}

    t.put("10.20.0.1", [0, 3, 1], 400)       # one more sample; 10.20.0.2 and 192.0.2.9 stood still
    got = {lab["remote_region"]: (list(h.slots), h.sum_ns) for _k, h, lab in src.entries("remote", t)}
    assert got == {"cn-north-1": ([0, 4, 1], 500), OTHER_REGION: ([0, 0, 4], 4000)}
    assert len(t) == 1 and src.deleted_idle == 2     # the idle ones left the map, not the totals

    t.put("10.20.0.2", [0, 0, 1], 50)         # back after its entry was deleted: counted from zero
    got = {lab["remote_region"]: (list(h.slots), h.sum_ns) for _k, h, lab in src.entries("remote", t)}
    assert got["cn-north-1"] == ([0, 4, 2], 550)
