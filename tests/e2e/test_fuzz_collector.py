"""Hostile input against a real collector process while a real agent streams to it.

Hypothesis sends, on raw Ingest streams (a generic gRPC stream-stream call whose serializer passes
bytes through): random bytes, valid message sequences with bytes flipped, cut or inserted, and
well-formed but hostile messages (wrong order, other nodes, huge sequence numbers, labels and names
over the limits, odd enum values, NaN...). Each stream must end with a gRPC status, never hang and
never UNKNOWN (an exception escaping the servicer); meanwhile the real agent's stored_up_to keeps
growing. Then the limits are checked one by one: each violation is a gRPC error for its stream.
"""

from __future__ import annotations

import collections
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import BIN, FAST_HOST_ONLY, free_port, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

INGEST = "/xpusense.v1.Ingest/Stream"
BUDGET_S = 25.0          # bound on the fuzzing phase; examples past it are skipped
MAX_EXAMPLES = 300
MAX_MESSAGE = 256 * 1024

COLLECTOR = f"""
max_message_bytes = {MAX_MESSAGE}
[limits]
max_samples_per_batch = 2000
max_labels_per_sample = 8
max_label_key_len = 64
max_label_value_len = 128
max_name_len = 128
max_text_len = 4096
max_histogram_buckets = 64
batches_per_s = 200
burst_batches = 400
"""

AGENT = FAST_HOST_ONLY

# ------------------------------------------------------------------------------------------ strategies

valid_ids = st.from_regex(r"fuzz-[a-z0-9.-]{1,8}", fullmatch=True)
node_ids = st.one_of(valid_ids, valid_ids, st.just(""), st.text(max_size=12).map(lambda s: "fuzz-" + s),
                     st.text(min_size=250, max_size=300).map(lambda s: "fuzz-" + s))
short = st.text(max_size=20)
boot_ids = st.one_of(st.from_regex(r"[0-9a-f]{1,32}", fullmatch=True), st.just(""), short)
texts = st.one_of(short, st.text(min_size=100, max_size=200))
label_maps = st.dictionaries(texts, texts, max_size=10)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)

histograms = st.builds(pb.Histogram, bounds=st.lists(st.floats(), max_size=70), counts=st.lists(u64, max_size=70),
                       sum=st.floats(), count=u64)
samples = st.builds(pb.Sample, name=texts, unit=short, kind=st.integers(-3, 7), labels=label_maps,
                    value=st.floats(), time_unix_nano=i64, histogram=histograms,
                    series_ref=st.integers(0, 2**32 - 1))
events = st.builds(pb.Event, id=short, type=texts, severity=short, device=short, message=texts,
                   attributes=label_maps, time_unix_nano=i64)
inventories = st.builds(pb.Inventory, hostname=texts, labels=label_maps,
                        resources=st.lists(st.builds(pb.Resource, type=short, vendor=short, model=texts,
                                                     attributes=label_maps, id=short), max_size=4))


@st.composite
def hostile_streams(draw) -> list[bytes]:
    node, boot = draw(node_ids), draw(boot_ids)
    msgs = []
    if draw(st.booleans()):
        msgs.append(pb.AgentMessage(hello=pb.Hello(node_id=node, boot_id=boot, agent_version=draw(short),
                                                   inventory=draw(inventories), time_unix_nano=draw(i64))))
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["batch", "batch", "inventory", "hello", "empty"]))
        if kind == "batch":
            b = pb.Batch(node_id=draw(st.one_of(st.just(node), node_ids)), boot_id=draw(st.one_of(st.just(boot), boot_ids)),
                         seq=draw(u64), sent_unix_nano=draw(i64))
            b.samples.extend(draw(st.lists(samples, max_size=12)))
            b.events.extend(draw(st.lists(events, max_size=3)))
            msgs.append(pb.AgentMessage(batch=b))
        elif kind == "inventory":
            msgs.append(pb.AgentMessage(inventory=draw(inventories)))
        elif kind == "hello":
            msgs.append(pb.AgentMessage(hello=pb.Hello(node_id=draw(node_ids), boot_id=draw(boot_ids))))
        else:
            msgs.append(pb.AgentMessage())
    return [m.SerializeToString() for m in msgs]


@st.composite
def mangled_streams(draw) -> list[bytes]:
    out = []
    for raw in draw(hostile_streams()):
        data = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
            at = draw(st.integers(0, len(data)))
            if op == "flip" and data:
                i = min(at, len(data) - 1)
                data[i] ^= draw(st.integers(1, 255))
            elif op == "cut":
                data = data[:at]
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            else:
                data[at:at] = data[:draw(st.integers(0, 32))]
        out.append(bytes(data))
    return out


garbage_streams = st.lists(st.binary(max_size=2048), min_size=1, max_size=4)
streams = st.one_of(garbage_streams, mangled_streams(), hostile_streams())


# ------------------------------------------------------------------------------------------ the test

def send(channel: grpc.Channel, msgs: list[bytes], timeout_s: float = 10.0) -> grpc.StatusCode:
    call = channel.stream_stream(INGEST, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        for _ in call(iter(msgs), timeout=timeout_s):
            pass
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def send_error(channel, msgs) -> grpc.RpcError | None:
    call = channel.stream_stream(INGEST, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        for _ in call(iter(msgs), timeout=20):
            pass
    except grpc.RpcError as e:
        return e
    return None


@pytest.fixture
def collector_and_agent(procs, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    ccfg = tmp_path / "collector.toml"
    ccfg.write_text(f'listen = "{addr}"\ndata_dir = "{tmp_path / "data"}"\n' + COLLECTOR)
    coll = procs([str(BIN / "xpusense-collector"), "serve", "--config", str(ccfg)], "collector")
    wait_until(lambda: "collector listening on" in coll.output(), what="the collector to listen")
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr,
                   "--node-id", "real-agent"], "agent")
    return addr, coll, agent


def test_fuzzed_streams_get_errors_while_the_real_agent_keeps_being_stored(collector_and_agent):
    addr, coll, agent = collector_and_agent
    channel = grpc.insecure_channel(addr)
    query = pb_grpc.QueryStub(channel)

    def stored_up_to() -> int:
        nodes = query.ListNodes(pb.ListNodesRequest(node_id="real-agent", name_prefix="-"), timeout=5).nodes
        return nodes[0].stored_up_to if nodes else 0

    marks = [wait_until(stored_up_to, what="the real agent to be stored")]
    codes: collections.Counter[str] = collections.Counter()
    t_end = time.monotonic() + BUDGET_S
    ran = [0]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(msgs=streams)
    def fuzz(msgs):
        if time.monotonic() > t_end:
            return
        code = send(channel, msgs)
        codes[code.name] += 1
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), \
            f"stream {msgs!r} ended with {code.name}: see the collector's log"
        ran[0] += 1
        if ran[0] % 60 == 0:   # the real agent is still served, every 60 hostile streams
            marks.append(wait_until(lambda: (v := stored_up_to()) > marks[-1] and v,
                                    what=f"the real agent to keep being stored (after {ran[0]} fuzzed streams)"))

    fuzz()
    print(f"fuzzed streams: {ran[0]}, ended with {dict(codes)}; real agent stored up to {marks}")
    assert ran[0] >= 50, f"only {ran[0]} fuzzed streams ran"
    # Errors, not silence: most hostile streams are refused with a status that says why.
    assert codes["INVALID_ARGUMENT"] > 0 and sum(v for k, v in codes.items() if k != "OK") > ran[0] // 4, codes

    # Each limit, on its own stream: a gRPC error naming it; the collector carries on.
    hello = pb.AgentMessage(hello=pb.Hello(node_id="fuzz-limits", boot_id="b1")).SerializeToString()

    def batch(seq, n_samples=1, **sample) -> bytes:
        b = pb.Batch(node_id="fuzz-limits", boot_id="b1", seq=seq)
        for i in range(n_samples):
            b.samples.add(**({"name": "x", "labels": {"i": str(i)}} | sample))
        return pb.AgentMessage(batch=b).SerializeToString()

    checks = [
        ([hello, batch(1, 2001)], grpc.StatusCode.INVALID_ARGUMENT, "max_samples_per_batch"),
        ([hello, batch(1, labels={str(i): "v" for i in range(9)})], grpc.StatusCode.INVALID_ARGUMENT,
         "max_labels_per_sample"),
        ([hello, batch(1, labels={"k": "v" * 129})], grpc.StatusCode.INVALID_ARGUMENT, "max_label_value_len"),
        ([hello, batch(1, labels={"k" * 65: "v"})], grpc.StatusCode.INVALID_ARGUMENT, "max_label_key_len"),
        ([hello, batch(1, name="n" * 129)], grpc.StatusCode.INVALID_ARGUMENT, "max_name_len"),
        ([hello, batch(1, kind=pb.HISTOGRAM, histogram=pb.Histogram(bounds=[float(i) for i in range(65)]))],
         grpc.StatusCode.INVALID_ARGUMENT, "max_histogram_buckets"),
        ([hello, batch(1, name="x" * 100, labels={"k": "v" * 100}, n_samples=0) + b"\x12" + b"\xff" * 10],
         None, ""),   # garbage after a valid message: any error but UNKNOWN
        ([hello, batch(1, labels={"k": "v" * MAX_MESSAGE})], grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        ([hello, batch(1), batch(2**64 - 1)], grpc.StatusCode.FAILED_PRECONDITION, "max_seq_jump"),
        ([hello] + [batch(i) for i in range(1, 1000)], grpc.StatusCode.RESOURCE_EXHAUSTED, "batches_per_s"),
    ]
    for msgs, code, words in checks:
        err = send_error(channel, msgs)
        assert err is not None, f"no error for {words or 'a malformed stream'}"
        if code is None:
            assert err.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK), err
        else:
            assert err.code() == code and words in (err.details() or ""), (words, err.code(), err.details())

    # Afterwards: the collector is up and healthy, the real agent still streams, nothing crashed.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    marks.append(wait_until(lambda: (v := stored_up_to()) > marks[-1] and v, what="the real agent after the fuzzing"))
    assert marks == sorted(marks) and len(set(marks)) == len(marks)
    assert coll.p.poll() is None and agent.p.poll() is None
    out = coll.output()
    assert "Traceback" not in out and "Unexpected" not in out, out[-3000:]
    # No forged log lines: every line is the collector's (a timestamp) or gRPC core's (I/W/E + date).
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} |[IWEF]\d{4} )")
    forged = [line for line in out.splitlines() if not stamp.match(line)]
    assert not forged, f"log lines not written by the collector: {forged[:3]!r}"
    assert "unreachable" not in agent.output(), "the real agent lost its stream during the fuzzing"
    channel.close()
