"""Ranked keeps the counts a decision asked for until it changes (ranked.py `memo`): a count asked
between any two changes is the sorted list's."""

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_sim import apply_fit_op

from xpusense.collector.scheduler import ranked
from xpusense.collector.scheduler.index import FEWER_AT_ALL, FEWER_OFFERED
from xpusense.collector.scheduler.ranked import Ranked

VALUES = st.sampled_from([FEWER_AT_ALL, FEWER_OFFERED, 0.0, 1.0, 2.5, 16.0, 40.0, 64.0]) | st.floats(0, 80)
PROBES = [FEWER_OFFERED, 0.0, 16.0, 40.0, 64.0]
OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "replace", "replace_each", "replace_same"]), VALUES,
                         st.integers(0, 10**6)), max_size=200)


@settings(max_examples=150, deadline=None)
@given(load=st.sampled_from([1, 2, 8, 512]), ops=OPS)
def test_a_kept_count_is_dropped_by_every_change(load, ops):
    old_load, ranked.LOAD = ranked.LOAD, load
    try:
        r, ref = Ranked(), []
        for op, v, pick in ops:
            for x in PROBES:   # asked (and kept) before each change
                assert r.at_least(x) == sum(1 for y in ref if y >= x)
            apply_fit_op(r, ref, op, v, pick)
        for x in PROBES + ref[:5]:
            assert r.at_least(x) == sum(1 for y in ref if y >= x)
    finally:
        ranked.LOAD = old_load


def test_the_kept_counts_are_bounded():
    r = Ranked([float(i) for i in range(100)])
    for x in range(3 * ranked.MEMO_MAX):
        assert r.at_least(float(x)) == 100 - x
        assert len(r.memo) <= ranked.MEMO_MAX
