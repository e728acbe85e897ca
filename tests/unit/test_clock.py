"""collector/clock.py: an agent's stamps on the collector's clock, the clock offset estimate (robust
to delays and a spool's resends, following a step within two windows), and the clock_offset
diagnosis opened, updated and closed on FleetState as batches arrive."""

from __future__ import annotations

from xpusense.collector import clock
from xpusense.collector.state import FleetState
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9
DAY = 86400 * S


def test_a_stamp_is_put_on_the_collector_clock_by_its_batch():
    recv = 1_000 * S
    assert clock.received_at(50 * S - 3 * S, 50 * S, recv) == recv - 3 * S   # 3 s before the batch was built
    assert clock.received_at(51 * S, 50 * S, recv) == recv                    # never after it arrived
    assert clock.received_at(5 * S, 0, recv) == recv and clock.received_at(0, 50 * S, recv) == recv


def test_the_offset_is_the_least_delayed_sample_and_follows_a_step():
    o = clock.ClockOffset()
    assert o.ns is None
    o.observe(0, 1 * S)                        # not stamped: no sample
    assert o.ns is None
    t = 100 * S
    o.observe(t + DAY - 2 * S, t)               # delayed by 2 s on the way
    o.observe(t + DAY - S // 100, t + S)        # ... by 10 ms
    o.observe(t - 3600 * S, t + 2 * S)          # a batch from the spool, built an hour before
    assert o.ns == DAY - S // 100 - S
    # The clock is stepped back a day: within two windows the estimate is the new offset.
    for i in range(3, 3 + 2 * clock.WINDOW_NS // S + 1):
        o.observe(t + i * S, t + i * S)
    assert o.ns == 0


def test_a_skewed_node_gets_a_diagnosis_updated_and_closed_as_its_clock_moves():
    now = [1_000_000 * S]
    st = FleetState(clock=lambda: now[0])
    st.configure(max_clock_offset_s=5.0)
    hello = pb.Hello(node_id="n", boot_id="b", time_unix_nano=now[0] - DAY)
    st.hello(hello)
    n = st.nodes["n"]
    assert clock.DIAGNOSIS_ID not in n.diagnoses   # behind on one sample: a delay would look the same
    seq = 0

    def batch(offset_ns: int) -> None:
        nonlocal seq
        seq += 1
        now[0] += S
        assert st.ingest(pb.Batch(node_id="n", boot_id="b", seq=seq, sent_unix_nano=now[0] + offset_ns))

    batch(-DAY)                                # the second sample says it too: opened
    d = n.diagnoses[clock.DIAGNOSIS_ID]
    assert d.attributes["diagnosis.rule"] == "clock_offset" and d.attributes["diagnosis.state"] == "open"
    assert float(d.attributes[clock.OFFSET]) == -86400.0 and "86400.0 s (1.0 days) behind" in d.message
    batch(-DAY + 3 * S)                        # within the bound of the open one: unchanged
    assert n.diagnoses[clock.DIAGNOSIS_ID] is d
    n.offset.reported = None                   # as after a restart: what it names is read off the event
    batch(-DAY + 3 * S)
    assert n.diagnoses[clock.DIAGNOSIS_ID] is d and n.offset.reported == -DAY
    now[0] += 2 * clock.WINDOW_NS              # both windows gone: the next sample is the estimate
    batch(DAY)                                 # a day ahead now: the same diagnosis, updated
    d2 = n.diagnoses[clock.DIAGNOSIS_ID]
    assert float(d2.attributes[clock.OFFSET]) == 86400.0 and "ahead of" in d2.message
    assert d2.attributes["diagnosis.opened_unix_nano"] == d.attributes["diagnosis.opened_unix_nano"]
    now[0] += 2 * clock.WINDOW_NS
    batch(S)                                   # synchronised: closed, the close among the recent events
    assert clock.DIAGNOSIS_ID not in n.diagnoses
    assert [e.attributes["diagnosis.state"] for e in n.events] == ["closed", "open", "open"]
    assert st.diagnoses.opened["clock_offset"] == 1


def test_a_delayed_hello_opens_nothing_and_a_clock_ahead_opens_at_once():
    """A Hello held up 8 s on the way (a collector many agents reach at once) reads as a clock 8 s
    behind: with the node's next batches on time, no diagnosis. A Hello a minute ahead cannot be a
    delay: opened on that one sample."""
    now = [1_000_000 * S]
    st = FleetState(clock=lambda: now[0])
    st.configure(max_clock_offset_s=5.0)
    st.hello(pb.Hello(node_id="late", boot_id="b", time_unix_nano=now[0] - 8 * S))
    for seq in range(1, 4):
        now[0] += S
        st.ingest(pb.Batch(node_id="late", boot_id="b", seq=seq, sent_unix_nano=now[0] - S // 10))
    assert not st.nodes["late"].diagnoses and not st.nodes["late"].events
    st.hello(pb.Hello(node_id="ahead", boot_id="b", time_unix_nano=now[0] + 60 * S))
    d = st.nodes["ahead"].diagnoses[clock.DIAGNOSIS_ID]
    assert "60.0 s ahead of" in d.message
