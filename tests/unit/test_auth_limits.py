"""The collector's limits and guards, identities in certificates, tokens, and the channel rules
(collector/limits.py, collector/auth.py, collector/certs.py, common/tls.py)."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import grpc
import pytest
from helpers import InProcessCollector

from xpusense.agent.config import ConfigError
from xpusense.collector.auth import Security, cert_identities
from xpusense.collector.certs import CertError, make_certs, make_tokens, parse_tokens, token_hash
from xpusense.collector.config import COLLECTOR_SCHEMA, load_collector
from xpusense.collector.limits import DEFAULTS, Limits
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


def test_series_per_boot_are_bounded():
    lim = Limits(max_series_per_boot=3, batches_per_s=1000)
    assert lim.check("n", batch(samples=[{"name": "x", "series_ref": r} for r in (1, 2)])) is None
    v = lim.check("n", batch(samples=[{"name": "x", "series_ref": r} for r in (2, 3, 4)]))
    assert v.code == EXHAUSTED and "limits.max_series_per_boot" in v.message
    assert lim.check("n", batch(samples=[{"name": "x", "series_ref": r} for r in (1, 2, 3)])) is None
    assert lim.check("n", batch(boot="next", samples=[{"name": "x", "series_ref": r} for r in (1, 2, 3)])) is None


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
