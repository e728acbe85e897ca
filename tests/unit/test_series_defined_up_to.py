"""The collector's answer to a Welcome's `series_defined_up_to`: the largest N with every
series_ref 1..N of the node's boot held, whatever gaps, bounds and other boots there are."""

from __future__ import annotations

from xpusense.collector.series_dictionary import SeriesDictionary
from xpusense.v1 import telemetry_pb2 as pb


def defs(*refs: int) -> list[pb.Sample]:
    return [pb.Sample(name=f"s{r}", unit="1", kind=pb.GAUGE, series_ref=r) for r in refs]


def test_refs_held_without_a_gap_from_one():
    d = SeriesDictionary()
    assert d.defined_up_to("n", "b") == 0
    d.add("n", "b", defs(1, 2, 3))
    assert d.defined_up_to("n", "b") == 3
    d.add("n", "b", defs(5, 6))                 # 4 never came: only 1..3 are all there
    assert d.defined_up_to("n", "b") == 3
    d.add("n", "b", defs(4))
    assert d.defined_up_to("n", "b") == 6
    assert d.defined_up_to("n", "other-boot") == 0 and d.defined_up_to("other-node", "b") == 0


def test_no_ref_one_is_none_and_the_bound_stops_it():
    d = SeriesDictionary(max_per_boot=4)
    d.add("n", "b", defs(2, 3))
    assert d.defined_up_to("n", "b") == 0
    d.add("n", "b2", defs(1, 2, 3, 4, 5, 6))    # past the bound: 5 and 6 dropped, not defined
    assert d.defined_up_to("n", "b2") == 4
    d.forget("n", "b2")
    assert d.defined_up_to("n", "b2") == 0
