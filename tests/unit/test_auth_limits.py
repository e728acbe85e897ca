"""The collector's limits and guards, identities in certificates, tokens, and the channel rules
(collector/limits.py, collector/auth.py, collector/certs.py, common/tls.py)."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import logging
from types import SimpleNamespace

import grpc
import pytest
from helpers import InProcessCollector

from xpusense.agent.config import ConfigError
from xpusense.collector.auth import Security, cert_identities
from xpusense.collector.certs import CertError, make_certs, make_tokens, parse_tokens, token_hash
from xpusense.collector.config import COLLECTOR_SCHEMA, load_collector
from xpusense.collector.limits import DEFAULTS, Limits, MalformedRequest
from xpusense.collector.server import IngestServicer
from xpusense.collector.state import FleetState
from xpusense.collector.store import Store
from xpusense.common.tls import is_loopback_host, make_channel
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


def batch(seq=1, boot="b", samples=(), events=()) -> pb.Batch:
    b = pb.Batch(node_id="n", boot_id=boot, seq=seq)
    for s in samples:
        b.samples.add(**s)
    for e in events:
        b.events.add(**e)
    return b


# ------------------------------------------------------------------------------------------ limits

def test_each_limit_is_an_error_naming_its_key():
    lim = Limits(max_samples_per_batch=3, max_labels_per_sample=2, max_label_key_len=4, max_label_value_len=5,
                 max_name_len=6, max_text_len=7, max_histogram_buckets=2, max_events_per_batch=1)
    cases = {
        "max_samples_per_batch": batch(samples=[{"name": "a"}] * 4),
        "max_labels_per_sample": batch(samples=[{"name": "a", "labels": {"a": "1", "b": "2", "c": "3"}}]),
        "max_label_key_len": batch(samples=[{"name": "a", "labels": {"kkkkk": "1"}}]),
        "max_label_value_len": batch(samples=[{"name": "a", "labels": {"k": "vvvvvv"}}]),
        "max_name_len": batch(samples=[{"name": "nnnnnnn"}]),
        "max_histogram_buckets": batch(samples=[{"name": "h", "kind": pb.HISTOGRAM,
                                                 "histogram": pb.Histogram(bounds=[1, 2, 3])}]),
        "max_events_per_batch": batch(events=[{"id": "1"}, {"id": "2"}]),
        "max_text_len": batch(events=[{"id": "1", "message": "m" * 8}]),
    }
    for key, b in cases.items():
        v = lim.check("n", b)
        assert v is not None and v.code == INVALID and f"limits.{key}" in v.message, (key, v)
    assert lim.check("n", batch(samples=[{"name": "ok", "labels": {"k": "v"}}] * 3)) is None
    assert lim.violations["INVALID_ARGUMENT"] == len(cases)


def test_rate_is_a_token_bucket_per_node():
    now = [100.0]
    lim = Limits(batches_per_s=2.0, burst_batches=3, clock=lambda: now[0])
    assert [lim.check("a", batch()) for _ in range(3)] == [None] * 3
    v = lim.check("a", batch())
    assert v.code == EXHAUSTED and "limits.batches_per_s" in v.message
    assert lim.check("b", batch()) is None          # another node has its own bucket
    assert lim.check("a", batch(boot="other")) is None   # so has another boot (another process claiming the node)
    now[0] += 0.5                                   # refills one batch at 2/s
    assert lim.check("a", batch()) is None
    assert lim.check("a", batch()).code == EXHAUSTED
    now[0] += 100                                   # never more than the burst
    assert [lim.check("a", batch()) is None for _ in range(4)] == [True, True, True, False]


def test_series_are_checked_once_per_reference_and_only_from_batches_that_passed():
    lim = Limits(max_label_value_len=5, batches_per_s=1000)
    good = {"name": "x", "labels": {"k": "v"}}
    long = {"name": "x", "labels": {"k": "v" * 6}}
    assert lim.check("n", batch(samples=[good | {"series_ref": 1}])) is None
    # The fleet state does not read labels of a known reference again, so neither do the limits.
    assert lim.check("n", batch(samples=[long | {"series_ref": 1}])) is None
    # A new reference, or none, is checked.
    assert lim.check("n", batch(samples=[long | {"series_ref": 2}])).code == INVALID
    assert lim.check("n", batch(samples=[long])).code == INVALID
    # Reference 3 came in a batch that was refused: it is not taken as checked.
    assert lim.check("n", batch(samples=[good | {"series_ref": 3}, long | {"series_ref": 4}])).code == INVALID
    assert lim.check("n", batch(samples=[long | {"series_ref": 3}])).code == INVALID
    # References belong to a boot.
    assert lim.check("n", batch(boot="other", samples=[long | {"series_ref": 1}])).code == INVALID


def test_series_per_boot_bound_the_references_remembered_never_the_stream():
    """Past max_series_per_boot a boot's batches still pass: the references idle longest are let go
    and new ones that do not fit are checked each time (a remembered one is not read again, so a
    bad label under it passes: that tells the two apart)."""
    now = [0.0]
    lim = Limits(max_series_per_boot=3, max_label_value_len=5, batches_per_s=1000, clock=lambda: now[0])
    lim.series_idle_s = 10.0
    good = [{"name": "x", "labels": {"k": "v"}, "series_ref": r} for r in range(8)]
    long = [{"name": "x", "labels": {"k": "v" * 6}, "series_ref": r} for r in range(8)]
    assert lim.check("n", batch(samples=good[1:3])) is None
    now[0] = 11.0                                    # a turn: 1 and 2 are the older generation
    assert lim.check("n", batch(samples=[good[2], good[3]])) is None   # 2 in use again; 3 new
    assert lim.hits["limits.max_series_per_boot"] == 0
    assert lim.check("n", batch(samples=good[4:6])) is None   # over 3: idle 1 let go, then 5 does not fit
    assert lim.hits["limits.max_series_per_boot"] == 1 and lim.hits["limits.series_refs.expired"] == 1
    assert lim.check("n", batch(samples=[long[4]])) is None        # remembered
    assert lim.check("n", batch(samples=[long[5]])).code == INVALID   # not remembered: read again
    assert lim.check("n", batch(samples=[long[1]])).code == INVALID   # let go: read again
    for _ in range(3):                               # whatever a boot sends, it is never refused for it
        assert lim.check("n", batch(samples=good[5:8])) is None
    assert lim.check("n", batch(boot="next", samples=good[1:4])) is None   # another boot: its own
    assert lim.check("n", batch(boot="next", samples=[long[3]])) is None


def test_references_idle_a_whole_generation_are_let_go():
    now = [0.0]
    lim = Limits(max_label_value_len=5, batches_per_s=1000, clock=lambda: now[0])
    lim.series_idle_s = 10.0
    good = [{"name": "x", "labels": {"k": "v"}, "series_ref": r} for r in range(3)]
    long = [{"name": "x", "labels": {"k": "v" * 6}, "series_ref": r} for r in range(3)]
    assert lim.check("n", batch(samples=good[1:3])) is None
    now[0] = 11.0
    assert lim.check("n", batch(samples=[good[1]])) is None   # a turn; 2 not used since: kept for now
    assert lim.hits["limits.series_refs.expired"] == 0
    now[0] = 22.0
    assert lim.check("n", batch(samples=[good[1]])) is None   # the next turn: 2 idle a whole generation
    assert lim.hits["limits.series_refs.expired"] == 1
    assert lim.check("n", batch(samples=[long[2]])).code == INVALID   # let go: read again
    assert lim.check("n", batch(samples=[long[1]])) is None           # in use: remembered


def test_limit_defaults_are_the_config_defaults():
    schema = COLLECTOR_SCHEMA["limits"]
    assert set(schema) == set(DEFAULTS)
    assert {k: schema[k].default for k in schema} == DEFAULTS
    cfg = load_collector(None, env={})
    assert vars(Limits.from_config(cfg.limits)).items() >= DEFAULTS.items()


# ------------------------------------------------------------------------------------------ guards on a real server

@pytest.fixture
def guarded():
    s = InProcessCollector(max_message_bytes=1 << 20, limits=Limits())
    yield s
    s.stop()


def raw_stream(addr, msgs):
    with grpc.insecure_channel(addr) as ch:
        call = ch.stream_stream("/xpusense.v1.Ingest/Stream", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        try:
            return list(call(iter(msgs), timeout=10)), None
        except grpc.RpcError as e:
            return None, e


def test_a_message_that_does_not_parse_ends_its_stream_with_invalid_argument(guarded):
    hello = pb.AgentMessage(hello=pb.Hello(node_id="n", boot_id="b")).SerializeToString()
    for msgs in ([b"\x00"], [hello, b"\x0a\x05\xff\xff\xff\xff\xff"], [b"\x12\x03\x0a\x01\xc3"]):
        _, err = raw_stream(guarded.addr, msgs)
        assert err is not None and err.code() == INVALID and "malformed message" in err.details(), (msgs, err)
    # ...and on a unary method (the Query API).
    with grpc.insecure_channel(guarded.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/xpusense.v1.Query/ListNodes", request_serializer=lambda b: b)(b"\xff\xff", timeout=5)
        assert e.value.code() == INVALID
        # A good call still works.
        assert pb_grpc.QueryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5).nodes is not None


def test_a_malformed_message_amid_acknowledgements_is_still_invalid_argument(guarded, caplog):
    """Ingest reads in a task of its own while its handler sends acks: the refusal of a message that
    does not parse must come from the handler's task (a status sent from the reader while an ack
    goes out is refused by gRPC, and the client saw UNKNOWN). Many batches before the bad message
    put acks in flight when it is read."""
    hello = pb.AgentMessage(hello=pb.Hello(node_id="n", boot_id="amid")).SerializeToString()
    codes = collections.Counter()
    for attempt in range(30):
        good = [pb.AgentMessage(batch=batch(seq=attempt * 100 + i, boot="amid", samples=[{"name": "x"}]))
                .SerializeToString() for i in range(1, 41)]
        _, err = raw_stream(guarded.addr, [hello, *good, b"\x0a\x05\xff\xff\xff\xff\xff"])
        codes[err.code().name if err is not None else "OK"] += 1
        assert err is not None and err.code() == INVALID and "malformed message" in err.details(), (attempt, err)
    assert codes == {"INVALID_ARGUMENT": 30}
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("durable", [False, True])
def test_ingest_ends_a_stream_with_a_malformed_message_from_the_handlers_own_task(durable, tmp_path):
    """The deterministic half of the test above: the abort (one status for the call) is sent by the
    task that also sends the acks. With a store a reader task reads ahead and hands the refusal over;
    without one the stream's one task reads."""
    aborts = []

    class Context:
        def peer(self):
            return "ipv4:127.0.0.1:1"

        async def abort(self, code, message):
            aborts.append((asyncio.current_task(), code, message))
            raise grpc.aio.AbortError(message)

    async def requests():
        yield pb.AgentMessage(hello=pb.Hello(node_id="n", boot_id="b"))
        yield pb.AgentMessage(batch=batch(seq=1, samples=[{"name": "x"}]))
        raise MalformedRequest("DecodeError: a test")

    state = FleetState()
    store = Store(str(tmp_path), fsync=False) if durable else None
    if store is not None:
        store.open(state)

    async def run():
        replies = []

        async def handler():
            async for out in IngestServicer(state, store=store).Stream(requests(), Context()):
                replies.append(out.WhichOneof("msg"))
        task = asyncio.create_task(handler())
        with pytest.raises(grpc.aio.AbortError):
            await task
        return task, replies

    try:
        task, replies = asyncio.run(run())
    finally:
        if store is not None:
            store.close()
    assert replies == ["welcome", "ack"]
    assert [(t is task, code, msg) for t, code, msg in aborts] == [
        (True, INVALID, "malformed message: DecodeError: a test")]


@pytest.mark.parametrize("node_id,boot_id", [("a\nforged line", "b"), ("", "b"), ("n" * 254, "b"), ("n", "b c"),
                                             ("n", "")])
def test_a_hello_with_an_unusable_id_is_refused(guarded, node_id, boot_id):
    msg = pb.AgentMessage(hello=pb.Hello(node_id=node_id, boot_id=boot_id)).SerializeToString()
    _, err = raw_stream(guarded.addr, [msg])
    assert err is not None and err.code() == INVALID


def test_a_batch_over_a_limit_ends_only_its_stream(guarded):
    hello = pb.AgentMessage(hello=pb.Hello(node_id="n", boot_id="b")).SerializeToString()
    b = batch(samples=[{"name": "x", "labels": {"k": "v" * 5000}}])
    _, err = raw_stream(guarded.addr, [hello, pb.AgentMessage(batch=b).SerializeToString()])
    assert err.code() == INVALID and "max_label_value_len" in err.details()
    ok = pb.AgentMessage(batch=batch(seq=2, samples=[{"name": "x"}])).SerializeToString()
    replies, err = raw_stream(guarded.addr, [hello, ok])
    assert err is None and len(replies) == 2    # welcome, ack


# ------------------------------------------------------------------------------------------ identities and tokens

def test_certs_bind_the_node_id_and_keys_are_private(tmp_path):
    made = make_certs(str(tmp_path), ["node-a", "node-b"], ["collector.example", "10.0.0.1"], days=2)
    assert made["ca_created"] and set(made["nodes"]) == {"node-a", "node-b"}
    for p in ["ca.key", "collector.key", "node-a.key", "node-b.key"]:
        assert (tmp_path / p).stat().st_mode & 0o777 == 0o600
    assert cert_identities((tmp_path / "node-a.pem").read_bytes()) == (["node-a"], True)
    ids, client_ok = cert_identities((tmp_path / "collector.pem").read_bytes())
    assert not client_ok                            # a server certificate cannot act as an agent
    ca = (tmp_path / "ca.pem").read_bytes()
    again = make_certs(str(tmp_path), ["node-c"])   # the CA is reused
    assert not again["ca_created"] and (tmp_path / "ca.pem").read_bytes() == ca
    with pytest.raises(CertError):
        make_certs(str(tmp_path), ["../etc"])


def _cert(cn, dns=(), uris=()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
         .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)))
    sans = [x509.DNSName(d) for d in dns] + [x509.UniformResourceIdentifier(u) for u in uris]
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_identity_from_uri_then_dns_then_cn():
    assert cert_identities(_cert("cn-id"))[0] == ["cn-id"]
    assert cert_identities(_cert("cn-id", dns=["dns-id"]))[0] == ["dns-id"]
    assert cert_identities(_cert("cn-id", dns=["dns-id"], uris=["xpusense://node/uri-id", "https://x"]))[0] == ["uri-id"]


def test_tokens_file_and_checks(tmp_path):
    made = make_tokens(str(tmp_path), ["a", "b"])
    table = parse_tokens((tmp_path / "tokens").read_text())
    assert set(table) == {"a", "b"} and (tmp_path / "a.token").stat().st_mode & 0o777 == 0o600
    make_tokens(str(tmp_path), ["c"])               # adding a node keeps the others
    assert parse_tokens((tmp_path / "tokens").read_text())["a"] == table["a"]
    tok_a = (tmp_path / "a.token").read_text().strip()
    assert token_hash(tok_a) == table["a"] and made["nodes"]["a"].endswith("a.token")
    sec = Security("127.0.0.1:1", tokens=table)
    md = lambda t: [("authorization", f"Bearer {t}")]  # noqa: E731
    assert sec._check_token(md(tok_a), "a")[0] is None
    assert sec._check_token(md(tok_a), "b")[0] == grpc.StatusCode.PERMISSION_DENIED
    assert sec._check_token(md("nope"), "a")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert sec._check_token([], "a")[0] == grpc.StatusCode.UNAUTHENTICATED
    for bad in ("a 123\n", "a " + "0" * 64 + "\na " + "1" * 64 + "\n", "just-one-field\n"):
        with pytest.raises(ValueError, match="line"):
            parse_tokens(bad)


# ------------------------------------------------------------------------------------------ plaintext rules, both ends

def collector_cfg(**kw):
    return SimpleNamespace(listen=kw.pop("listen", "127.0.0.1:7470"), tokens_file=kw.pop("tokens_file", ""),
                           allow_insecure=kw.pop("allow_insecure", False),
                           tls=SimpleNamespace(ca=kw.pop("ca", ""), cert=kw.pop("cert", ""), key=kw.pop("key", "")))


def test_collector_refuses_plaintext_on_the_network_unless_allowed(tmp_path):
    assert Security.from_config(collector_cfg()).describe().startswith("plaintext")
    with pytest.raises(ConfigError, match="allow_insecure") as e:
        Security.from_config(collector_cfg(listen="0.0.0.0:7470"))
    assert "\n" not in str(e.value)
    assert Security.from_config(collector_cfg(listen="0.0.0.0:7470", allow_insecure=True)).server_credentials() is None
    made = make_certs(str(tmp_path), ["n"])
    sec = Security.from_config(collector_cfg(listen="0.0.0.0:7470", ca=made["ca"], cert=made["collector"]["cert"],
                                             key=made["collector"]["key"]))
    assert sec.mtls and sec.server_credentials() is not None
    with pytest.raises(ConfigError, match="not authenticated"):   # TLS, but anyone may claim any node
        Security.from_config(collector_cfg(listen="0.0.0.0:7470", cert=made["collector"]["cert"],
                                           key=made["collector"]["key"]))
    with pytest.raises(ConfigError, match="tls.key"):
        Security.from_config(collector_cfg(cert=made["collector"]["cert"]))
    with pytest.raises(ConfigError, match="tls.ca"):
        Security.from_config(collector_cfg(ca=made["ca"]))


def agent_keys(**kw):
    return SimpleNamespace(**({"tls_ca": "", "tls_cert": "", "tls_key": "", "token_file": "", "insecure": False} | kw))


def test_agent_channel_rules_name_the_key(tmp_path):
    assert make_channel("127.0.0.1:7470", agent_keys()).mode == "plaintext"
    assert make_channel("localhost:7470", agent_keys()).mode == "plaintext"
    with pytest.raises(ConfigError, match="collector.insecure"):
        make_channel("192.0.2.1:7470", agent_keys())
    assert make_channel("192.0.2.1:7470", agent_keys(insecure=True)).mode == "plaintext"
    made = make_certs(str(tmp_path), ["n"])
    n = made["nodes"]["n"]
    assert make_channel("192.0.2.1:7470", agent_keys(tls_ca=made["ca"], tls_cert=n["cert"], tls_key=n["key"])).mode == "mTLS"
    with pytest.raises(ConfigError, match="collector.tls_key"):
        make_channel("127.0.0.1:7470", agent_keys(tls_cert=n["cert"]))
    with pytest.raises(ConfigError, match="collector.tls_ca"):
        make_channel("127.0.0.1:7470", agent_keys(tls_ca=str(tmp_path / "missing.pem")))
    tok = tmp_path / "t"
    tok.write_text("two tokens\n")
    with pytest.raises(ConfigError, match="collector.token_file"):
        make_channel("127.0.0.1:7470", agent_keys(token_file=str(tok)))
    tok.write_text("secret\n")
    assert make_channel("127.0.0.1:7470", agent_keys(tls_ca=made["ca"], token_file=str(tok))).mode == "TLS + token"


def test_loopback_hosts():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("[::1]")
    assert is_loopback_host("127.3.2.1") and is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("") and not is_loopback_host("192.0.2.1")
    assert not is_loopback_host("::")


def test_localhost_is_loopback_by_name_even_without_a_resolver(monkeypatch):
    # A fresh host may have no /etc/hosts entry for localhost: name resolution must not decide.
    import socket

    def no_resolver(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_resolver)
    assert is_loopback_host("localhost") and is_loopback_host("LOCALHOST.") and is_loopback_host("agent.localhost")
    assert not is_loopback_host("localhost.example.com") and not is_loopback_host("notlocalhost")


# ------------------------------------------------------------------------------------------ bounds against hostile clients

def _state_and_limits(now_ns, **limits):
    from xpusense.collector.state import FleetState
    st = FleetState(history_s=60, clock=lambda: now_ns[0])
    lim = Limits(**({"batches_per_s": 10.0, "burst_batches": 10**6} | limits))
    st.max_series_per_node = lim.max_series_per_node
    return st, lim


def test_a_forged_sequence_number_far_ahead_is_refused_and_the_bound_grows_with_time():
    now = [10**18]
    st, lim = _state_and_limits(now, max_seq_jump=100)
    st.hello(pb.Hello(node_id="n", boot_id="b"))
    assert lim.check("n", batch(seq=2**64 - 1), st) is None      # nothing stored yet: nothing to count from
    assert st.ingest(batch(seq=5))
    v = lim.check("n", batch(seq=2**64 - 1), st)
    assert v.code == grpc.StatusCode.FAILED_PRECONDITION and "limits.max_seq_jump" in v.message
    assert lim.check("n", batch(seq=106), st).code == grpc.StatusCode.FAILED_PRECONDITION
    assert lim.check("n", batch(seq=105), st) is None             # mark 5 + max_seq_jump 100
    now[0] += 30 * 10**9                                          # 30 s later: + 30 s x 10 batches/s
    assert lim.check("n", batch(seq=405), st) is None
    assert lim.check("n", batch(seq=406), st) is not None
    assert lim.hits["limits.max_seq_jump"] == 3
    # A gap the agent really made (its spool dropped the oldest batches during an outage) passes.
    assert st.ingest(batch(seq=400)) and lim.check("n", batch(seq=401), st) is None
    # Marks restored from the durable store count from when the store was last written.
    from xpusense.collector.state import FleetState
    again = FleetState(clock=lambda: now[0])
    again.known_marks[("n", "b")] = 400
    again.restored_at_ns = now[0] - 100 * 10**9
    assert again.seq_ceiling("n", "b", 100, 10.0) == 400 + 100 + 1000
    assert again.seq_ceiling("n", "unknown-boot", 100, 10.0) is None
    # A mark rebuilt by the store's replay counts from when its batch was sent, not from the replay.
    assert again.ingest(batch(seq=450), now_ns=now[0] - 50 * 10**9)
    assert again.seq_ceiling("n", "b", 100, 10.0) == 450 + 100 + 500


def test_series_per_node_are_counted_whatever_the_series_ref():
    now = [10**18]
    st, lim = _state_and_limits(now, max_series_per_node=10)
    st.hello(pb.Hello(node_id="n", boot_id="b"))
    seq = iter(range(1, 100))

    def send(samples):
        b = batch(seq=next(seq), samples=samples)
        v = lim.check("n", b, st)
        if v is None:
            st.ingest(b)
        return v

    # series_ref 0 ("no reference") with new labels each time: counted all the same.
    assert send([{"name": "x", "labels": {"i": str(i)}, "time_unix_nano": now[0]} for i in range(8)]) is None
    v = send([{"name": "x", "labels": {"i": str(i)}, "time_unix_nano": now[0]} for i in range(8, 11)])
    assert v.code == EXHAUSTED and "limits.max_series_per_node = 10" in v.message and "adds 3" in v.message
    assert send([{"name": "x", "labels": {"i": str(i)}, "time_unix_nano": now[0]} for i in range(8, 10)]) is None
    assert st.series_count("n") == 10
    # Samples of series the node has pass, by reference or not; references of a new boot too.
    assert send([{"name": "x", "labels": {"i": "3"}, "time_unix_nano": now[0]}]) is None
    assert lim.check("n", batch(seq=50, boot="b2", samples=[{"name": "x", "labels": {"i": "1"}, "series_ref": 7}]),
                     st) is None
    # Series with no point for history_s are let go when room is needed.
    now[0] += 120 * 10**9
    assert send([{"name": "y", "labels": {"i": str(i)}, "time_unix_nano": now[0]} for i in range(5)]) is None
    assert st.series_count("n") == 5 and st.counters["series_expired"] == 10
    assert lim.hits["limits.max_series_per_node"] == 1


def test_the_state_holds_its_series_bound_even_for_batches_admitted_together():
    from xpusense.collector.state import FleetState
    st = FleetState()
    st.max_series_per_node = 4
    for seq in (1, 2):   # each admitted against the series there before either was applied
        st.ingest(batch(seq=seq, samples=[{"name": "x", "labels": {"s": str(seq), "i": str(i)}} for i in range(3)]))
    assert st.series_count("n") == 4
    assert st.counters["limits.max_series_per_node.samples_dropped"] == 2


def test_boots_with_an_open_stream_are_never_forgotten():
    from xpusense.collector.state import MAX_BOOTS_REMEMBERED, FleetState
    st = FleetState()
    st.hello(pb.Hello(node_id="n", boot_id="real"))
    assert st.ingest(batch(seq=7, boot="real"))
    for i in range(3 * MAX_BOOTS_REMEMBERED):   # made-up boots, by Hello and by batches of other boots
        st.hello(pb.Hello(node_id="n", boot_id=f"made-up-{i}"))
        st.disconnected("n", f"made-up-{i}")
        st.ingest(batch(seq=1, boot=f"replayed-{i}"))
    n = st.nodes["n"]
    assert n.stored_up_to["real"] == 7 and len(n.stored_up_to) <= MAX_BOOTS_REMEMBERED + 1
    assert not st.ingest(batch(seq=7, boot="real"))   # still a resend, never stored twice
    st.disconnected("n", "real")
    st.hello(pb.Hello(node_id="n", boot_id="another"))
    st.ingest(batch(seq=1, boot="one-more"))
    assert "real" not in n.stored_up_to               # no stream open for it: forgotten like any other


def _fleet(nodes=3, series=400, label_len=300):
    from xpusense.collector.state import FleetState
    st = FleetState()
    for k in range(nodes):
        nid = f"node-{k}"
        st.hello(pb.Hello(node_id=nid, boot_id=f"boot-{k}", inventory=pb.Inventory(hostname=nid)))
        st.ingest(pb.Batch(node_id=nid, boot_id=f"boot-{k}", seq=1, samples=[
            pb.Sample(name=f"m.{i % 7}", labels={"i": str(i), "pad": "p" * label_len}, value=i, series_ref=i + 1)
            for i in range(series)], events=[pb.Event(id=str(e), type="t", message="e" * 500) for e in range(20)]))
    return st


def test_list_nodes_pages_stay_under_the_byte_bound_and_merge_back_to_the_whole_fleet():
    from xpusense.collector.views import fetch_all
    st = _fleet()
    whole = st.view()
    assert whole.ByteSize() > 300_000
    pages = []

    def call(req):
        reply = st.view(req.node_id, req.name_prefix, req.page_token, req.page_size, max_bytes=50_000)
        pages.append(reply)
        return reply

    merged = fetch_all(call, pb.ListNodesRequest())
    assert len(pages) > 6 and all(p.ByteSize() <= 50_000 for p in pages)
    assert any(nv.continued for p in pages for nv in p.nodes)   # a node's series went on over a page
    assert [nv.node_id for nv in merged.nodes] == [nv.node_id for nv in whole.nodes]
    for got, want in zip(merged.nodes, whole.nodes):
        assert [(s.name, dict(s.labels)) for s in got.series] == [(s.name, dict(s.labels)) for s in want.series]
        assert list(got.events) == list(want.events) and got.series_total == 400
    # By node count, with a name prefix, for one node.
    assert [nv.node_id for nv in st.view(page_size=2).nodes] == ["node-0", "node-1"]
    assert st.view(page_size=2).next_page_token
    one = fetch_all(lambda r: st.view(r.node_id, r.name_prefix, r.page_token, max_bytes=20_000),
                    pb.ListNodesRequest(node_id="node-1", name_prefix="m.3"))
    assert [nv.node_id for nv in one.nodes] == ["node-1"]
    assert {s.name for s in one.nodes[0].series} == {"m.3"} and len(one.nodes[0].series) == 57
    assert one.nodes[0].series_total == 57
    # Events over the bound are left out and counted, never cut into a page on their own.
    few = st.view(node_id="node-0", max_bytes=3_000)
    assert few.nodes[0].events_omitted > 0 and len(few.nodes[0].events) + few.nodes[0].events_omitted == 20
    with pytest.raises(ValueError, match="page_token"):
        st.view(page_token="not a token of ours")


def test_boot_ids_are_left_out_for_callers_not_trusted():
    st = _fleet(nodes=2, series=1)
    shown, hidden = st.view(), st.view(boot_ids=False)
    assert [nv.boot_id for nv in shown.nodes] == ["boot-0", "boot-1"]
    assert [nv.boot_id for nv in hidden.nodes] == ["", ""]
    assert [nv.boot_tag for nv in hidden.nodes] == [nv.boot_tag for nv in shown.nodes]
    assert hidden.nodes[0].boot_tag != hidden.nodes[1].boot_tag and "boot-0" not in str(hidden)


# /proc/net/tcp and tcp6 as Linux prints them (x86-64): 127.0.0.1:39018 owned by uid 1000, [::1]:41234
# by uid 0, 127.0.0.1:7470 (the listener) by uid 998, and [::ffff:127.0.0.1]:50000 by uid 65534.
PROC_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1D2E 00000000:0000 0A 00000000:00000000 00:00000000 00000000   998        0 41234 1 0 100 0 0 10 0
   1: 0100007F:986A 0100007F:1D2E 01 00000000:00000000 00:00000000 00000000  1000        0 51234 1 0 20 4 30 10 -1
"""
PROC_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:A112 00000000000000000000000001000000:1D2E 01 00000000:00000000 00:00000000 00000000     0        0 61234 1 0 20 4 30 10 -1
   1: 0000000000000000FFFF00000100007F:C350 0000000000000000FFFF00000100007F:1D2E 01 00000000:00000000 00:00000000 00000000 65534        0 71234 1 0 20 4 30 10 -1
"""


def test_the_owner_of_a_loopback_peer_is_read_from_proc_net(tmp_path):
    from xpusense.collector.query import loopback_peer_uid
    (tmp_path / "tcp").write_text(PROC_TCP)
    (tmp_path / "tcp6").write_text(PROC_TCP6)
    uid = lambda peer: loopback_peer_uid(peer, str(tmp_path))  # noqa: E731
    assert uid("ipv4:127.0.0.1:39018") == 1000
    assert uid("ipv6:[::1]:41234") == 0
    assert uid("ipv4:127.0.0.1:50000") == 65534 and uid("ipv6:[::ffff:127.0.0.1]:50000") == 65534
    assert uid("ipv4:127.0.0.1:1") is None                   # no such socket
    assert uid("ipv4:192.0.2.7:39018") is None              # not loopback: never looked up
    assert uid("unix:/run/x.sock") is None and uid("") is None


def test_the_owner_of_a_real_loopback_connection(tmp_path):
    import os
    import socket

    from xpusense.collector.query import loopback_peer_uid
    with socket.create_server(("127.0.0.1", 0)) as srv:
        c = socket.create_connection(srv.getsockname())
        try:
            port = c.getsockname()[1]
            assert loopback_peer_uid(f"ipv4:127.0.0.1:{port}") == os.geteuid()
        finally:
            c.close()


def test_streams_nodes_and_inventories_are_bounded_on_a_real_server():
    import threading
    lim = Limits(max_streams=2, max_nodes=3, max_inventory_bytes=1000)
    s = InProcessCollector(limits=lim)
    release = threading.Event()

    def held(node):   # a stream kept open until the test lets go
        yield pb.AgentMessage(hello=pb.Hello(node_id=node, boot_id="b"))
        release.wait(30)

    try:
        with grpc.insecure_channel(s.addr) as ch:
            stub = pb_grpc.IngestStub(ch)
            calls = [stub.Stream(held(f"n{i}")) for i in range(2)]
            for c in calls:
                assert next(c).HasField("welcome")
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Stream(iter([pb.AgentMessage(hello=pb.Hello(node_id="n2", boot_id="b"))]), timeout=10))
            assert e.value.code() == EXHAUSTED and "limits.max_streams = 2" in e.value.details()
            release.set()
            for c in calls:
                list(c)
            hello = lambda node, inv=None: pb.AgentMessage(hello=pb.Hello(node_id=node, boot_id="b", inventory=inv))  # noqa: E731
            assert list(stub.Stream(iter([hello("n2")]), timeout=10))[0].HasField("welcome")
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Stream(iter([hello("n3")]), timeout=10))
            assert e.value.code() == EXHAUSTED and "limits.max_nodes = 3" in e.value.details()
            big = pb.Inventory(hostname="h" * 2000)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Stream(iter([hello("n0", big)]), timeout=10))
            assert e.value.code() == INVALID and "limits.max_inventory_bytes" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Stream(iter([hello("n0"), pb.AgentMessage(inventory=big)]), timeout=10))
            assert e.value.code() == INVALID and "limits.max_inventory_bytes" in e.value.details()
            counters = pb_grpc.QueryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5).counters
            assert counters["limits.max_streams"] == 1 and counters["limits.max_nodes"] == 1
            assert counters["limits.max_inventory_bytes"] == 2
            assert sorted(s.on_loop(lambda: list(s.state.nodes))) == ["n0", "n1", "n2"]
    finally:
        release.set()
        s.stop()
