"""The choice of driver counters, on statistics recorded from real drivers (no root)."""

from __future__ import annotations

from xpusense.agent.sources.driver_stats import DRIVER_ERRORS, DRIVER_ERRORS_OMITTED, driver_error_samples, error_counters

# `ethtool -S` of an ixgbe port (abridged) and of a veth
IXGBE = [("rx_packets", 912), ("tx_packets", 880), ("rx_crc_errors", 3), ("rx_missed_errors", 7),
         ("rx_fifo_errors", 0), ("rx_no_dma_resources", 0), ("tx_dropped", 2), ("rx_length_errors", 1),
         ("alloc_rx_page_failed", 0), ("rx_long_length_errors", 0), ("os2bmc_rx_by_bmc", 0), ("fdir_miss", 5)]
VETH = [("peer_ifindex", 2), ("rx_queue_0_xdp_packets", 0), ("rx_queue_0_drops", 0), ("rx_queue_0_xdp_drops", 4)]


def test_only_error_drop_discard_miss_fifo_crc_counters_in_the_drivers_order():
    kept, omitted = error_counters(IXGBE, 16)
    assert kept == [("rx_crc_errors", 3), ("rx_missed_errors", 7), ("rx_fifo_errors", 0), ("tx_dropped", 2),
                    ("rx_length_errors", 1), ("rx_long_length_errors", 0), ("fdir_miss", 5)]
    assert omitted == 0
    assert error_counters(VETH, 16) == ([("rx_queue_0_drops", 0), ("rx_queue_0_xdp_drops", 4)], 0)


def test_the_limit_cuts_and_says_how_many_were_left_out():
    samples = driver_error_samples("eth0", IXGBE, 3)
    counters = [(s.labels["counter"], s.value) for s in samples if s.name == DRIVER_ERRORS]
    assert counters == [("rx_crc_errors", 3.0), ("rx_missed_errors", 7.0), ("rx_fifo_errors", 0.0)]
    [om] = [s for s in samples if s.name == DRIVER_ERRORS_OMITTED]
    assert om.value == 4 and om.labels == {"device": "eth0"}
    assert driver_error_samples("lo", [], 3) == []
