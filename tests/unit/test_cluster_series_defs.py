"""A gateway stream's series tables (collector/cluster/series_defs.py StreamTables): checked before
they are written to the series bucket, keyed by node, boot and highest ref, written again every
half TTL while the stream lasts, bounded, and the stream's compact batches checked against them;
the [nats] series keys' cross-check."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from xpusense.collector.cluster.cli import load_config
from xpusense.collector.cluster.series_defs import StreamTables, boot_keys, table_key
from xpusense.collector.limits import Limits, Violation
from xpusense.collector.wire import CompactBatch
from xpusense.common import compact
from xpusense.common.config import ConfigError
from xpusense.v1 import telemetry_pb2 as pb


class Bucket:
    """A KV bucket's put, recorded; failing while `down`."""

    def __init__(self):
        self.puts: list[tuple[str, bytes]] = []
        self.down = False

    async def put(self, key: str, value: bytes) -> int:
        await asyncio.sleep(0)
        if self.down:
            raise TimeoutError("no answer")
        self.puts.append((key, value))
        return len(self.puts)


def _defs(*refs: int) -> list[pb.Sample]:
    return [pb.Sample(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": f"gpu{r}"}, series_ref=r)
            for r in refs]


def _table(*refs: int, boot: str = "b1") -> pb.SeriesTable:
    return pb.SeriesTable(boot_id=boot, defs=compact.encode_defs(_defs(*refs)))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _tables(bucket: Bucket, clock: Clock, **limits) -> tuple[StreamTables, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    return StreamTables(bucket.put, "node.a", Limits(**limits), 100.0, counts, clock=clock), counts


def test_tables_are_written_by_node_boot_and_highest_ref_and_again_every_half_ttl():
    async def go():
        bucket, clock = Bucket(), Clock()
        st, counts = _tables(bucket, clock)
        assert st.add(_table(1, 2, 3)) is None
        assert st.add(_table(4, boot="b 2")) is None
        assert await st.written() is None
        assert bucket.puts == [("node=2Ea.b1.3", _table(1, 2, 3).defs), ("node=2Ea.b=202.4", _table(4).defs)]
        assert table_key("node.a", "b1", 3) == "node=2Ea.b1.3" and boot_keys("node.a", "b1") == "node=2Ea.b1.*"
        assert counts["series.tables_written"] == 2
        clock.t += 49.0                      # within half the TTL: nothing written again
        assert await st.written() is None and len(bucket.puts) == 2
        clock.t += 2.0                       # past it: every table of the stream again
        assert await st.written() is None
        assert sorted(bucket.puts[2:]) == sorted(bucket.puts[:2])
        bucket.down = True                   # the bucket does not answer: the stream ends, UNAVAILABLE
        assert st.add(_table(5)) is None
        v = await st.written()
        assert isinstance(v, Violation) and v.code == grpc.StatusCode.UNAVAILABLE and "series bucket" in v.message
        assert counts["series.tables_unwritten"] == 1
    asyncio.run(go())


def test_tables_and_batches_the_stream_cannot_stand_by_are_refused():
    async def go():
        bucket, clock = Bucket(), Clock()
        st, counts = _tables(bucket, clock, max_series_table_bytes=4096)
        v = st.add(pb.SeriesTable(boot_id="b1", defs=b"not zlib"))
        assert v is not None and v.code == grpc.StatusCode.INVALID_ARGUMENT and "do not inflate" in v.message
        v = st.add(pb.SeriesTable(boot_id="b1", defs=compact.encode_defs([pb.Sample(name="x")])))
        assert v is not None and v.code == grpc.StatusCode.INVALID_ARGUMENT and "without a series_ref" in v.message
        long = pb.Sample(name="x" * 300, unit="1", kind=pb.GAUGE, series_ref=1)   # limits.max_name_len: 256
        v = st.add(pb.SeriesTable(boot_id="b1", defs=compact.encode_defs([long])))
        assert v is not None and v.code == grpc.StatusCode.INVALID_ARGUMENT and v.key == "max_name_len"
        assert st.add(_table(*range(1, 21))) is None
        assert st.add(_table(3, 4)) is None   # defined again alike (a resend): taken
        other = pb.Sample(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": "gpu9"}, series_ref=3)
        v = st.add(pb.SeriesTable(boot_id="b1", defs=compact.encode_defs([other])))
        assert v is not None and v.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "series_ref 3 is defined as hw.gpu.utilization{'device': 'gpu3'} in this boot" in v.message
        refusals = [v for boot in range(2, 200) if (v := st.add(_table(*range(1, 21), boot=f"b{boot}")))]
        assert refusals and st.bytes <= 4096 < st.bytes + len(_table(*range(1, 21)).defs)   # the stream's tables, bounded
        v = refusals[0]
        assert v.code == grpc.StatusCode.RESOURCE_EXHAUSTED and v.key == "max_series_table_bytes"
        refused = 4 + len(refusals)
        assert counts["series.tables_refused"] == refused
        await st.written()
        ok = pb.Batch(node_id="node.a", boot_id="b1", seq=1, columns=compact.encode_columns([(1, 5, 0.5), (20, 5, 1.0)]))
        assert isinstance(st.batch(ok), CompactBatch) and st.batch(ok).rows() == [(1, 5, 0.5), (20, 5, 1.0)]
        v = st.batch(pb.Batch(node_id="node.a", boot_id="b1", seq=2, columns=compact.encode_columns([(21, 5, 0.5)])))
        assert isinstance(v, Violation) and v.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no definition for series_ref 21" in v.message
        v = st.batch(pb.Batch(node_id="node.a", boot_id="b1", seq=3, columns=b"\x78\x9c junk"))
        assert isinstance(v, Violation) and v.code == grpc.StatusCode.INVALID_ARGUMENT and "columns" in v.message
        assert counts["series.batches_refused"] == 2
    asyncio.run(go())


def test_series_ttl_must_outlast_twice_the_streams_retention(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[nats]\nurls = ["nats://127.0.0.1:4222"]\nretention_s = 900\nseries_ttl_s = 1000\n')
    with pytest.raises(ConfigError, match=r"'nats.series_ttl_s' \(1000\) must be at least twice 'nats.retention_s'"):
        load_config(str(path), {}, env={})
    path.write_text('[nats]\nurls = ["nats://127.0.0.1:4222"]\nretention_s = 900\nseries_ttl_s = 1800\n')
    assert load_config(str(path), {}, env={}).nats.series_bucket == "series"
