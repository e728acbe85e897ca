"""The web-config file of /metrics (collector/web_config.py): each bad file is refused naming its
key, at `serve` and `scheduler` alike (exit 2); basic auth answers 401 with a Basic challenge and
remembers a verified password, so only the first scrape pays for bcrypt."""

from __future__ import annotations

import base64
import socket
import ssl
import urllib.request

import bcrypt
import pytest
from helpers import free_port, wait_until

from xpusense.collector import web_config
from xpusense.collector.certs import make_certs
from xpusense.collector.cli import main as collector_main
from xpusense.collector.config import load_collector
from xpusense.common.config import ConfigError

HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(str(tmp_path_factory.mktemp("certs")), ["prometheus"])


def tls(certs, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {certs['collector']['cert']}\n  key_file: {certs['collector']['key']}\n{extra}"


BAD = [  # (file text, with {tls} for a good tls_server_config head; words the error must hold)
    ("tls_server_config:\n  cert_file: /nonexistent.pem\n  key_file: /nonexistent.key\n",
     ["tls_server_config.cert_file", "/nonexistent.pem"]),
    ("tls_server_config:\n  cert_file: {cert}\n", ["tls_server_config.key_file", "required"]),
    ("{tls}  client_auth_type: RequireAnyClientCert\n", ["tls_server_config.client_auth_type", "RequireAnyClientCert"]),
    ("{tls}  client_auth_type: RequireAndVerifyClientCert\n", ["tls_server_config.client_ca_file", "required"]),
    ("{tls}  client_ca_file: {ca}\n", ["tls_server_config.client_ca_file", "NoClientCert"]),
    ("{tls}  min_version: TLS14\n", ["tls_server_config.min_version", "TLS14"]),
    ("{tls}  min_version: TLS13\n  max_version: TLS12\n", ["tls_server_config.min_version", "above"]),
    ("{tls}  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", ["tls_server_config.cipher_suites", "not supported"]),
    ("{tls}  cert: inline\n", ["tls_server_config.cert", "not supported"]),
    ("{tls}  ciphers: []\n", ["tls_server_config.ciphers", "not a web-config key"]),
    ("rate_limit:\n  burst: 20\n", ["rate_limit", "not supported"]),
    ("basic_auth_user:\n  a: b\n", ["basic_auth_user", "not a web-config key"]),
    ("basic_auth_users:\n  alice: plaintext\n", ["basic_auth_users.alice", "bcrypt"]),
    ("basic_auth_users:\n  alice: '$2y$99$mDwo.lAisC94iLAyP81MCesa29IzH37oigHC/42V2pdJlUprsJPze'\n",
     ["basic_auth_users.alice", "bcrypt"]),
    ("basic_auth_users: [alice]\n", ["basic_auth_users", "mapping"]),
    ("http_server_config:\n  headers:\n    X-Powered-By: me\n", ["http_server_config.headers.X-Powered-By"]),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
     ["http_server_config.headers.X-Frame-Options", "deny"]),
    ("http_server_config:\n  http2: maybe\n", ["http_server_config.http2"]),
    ("tls_server_config: [\n", ["not valid YAML"]),
    ("- a\n", ["(top level)", "mapping"]),
]


@pytest.mark.parametrize(("text", "words"), BAD, ids=[w[0] for _, w in BAD])
def test_a_bad_file_is_refused_naming_its_key(tmp_path, certs, text, words):
    path = tmp_path / "web.yml"
    path.write_text(text.format(tls=tls(certs), cert=certs["collector"]["cert"], ca=certs["ca"]))
    with pytest.raises(ConfigError) as e:
        web_config.load(str(path))
    assert str(path) in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_a_missing_file_and_the_config_key_name_it(tmp_path):
    with pytest.raises(ConfigError, match="web-config file /nonexistent/web.yml: cannot read it"):
        web_config.load("/nonexistent/web.yml")
    (tmp_path / "c.toml").write_text('[export.prometheus]\nweb_config_file = "/nonexistent/web.yml"\n')
    with pytest.raises(ConfigError, match=r"'export\.prometheus\.web_config_file' names a bad file"):
        load_collector(str(tmp_path / "c.toml"))


@pytest.mark.parametrize("argv", [["serve"], ["scheduler", "--nats", "nats://127.0.0.1:1"]])
def test_serve_and_scheduler_exit_2_on_a_bad_file(tmp_path, capsys, argv):
    bad = tmp_path / "web.yml"
    bad.write_text("basic_auth_users:\n  alice: plaintext\n")
    assert collector_main([*argv, "--web-config-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'export.prometheus.web_config_file'" in err and "basic_auth_users.alice" in err


def test_a_good_file_gives_tls_users_and_headers(tmp_path, certs):
    path = tmp_path / "web.yml"
    path.write_text(tls(certs, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {certs['ca']}\n"
                               "  min_version: TLS13\n")
                    + f"http_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n"
                      f"basic_auth_users:\n  alice: '{HASH}'\n")
    web = web_config.load(str(path))
    assert web.ssl_context is not None and web.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert web.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert web.users == {"alice": HASH.encode()} and web.headers == {"X-Frame-Options": "deny"}


def call(app, authorization: str | None):
    got = {}

    def start_response(status, headers, exc_info=None):
        got["status"], got["headers"] = status, dict(headers)
    environ = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth_answers_401_and_bcrypts_a_good_password_once(monkeypatch):
    web = web_config.WebConfig("web.yml", users={"alice": HASH.encode()}, headers={"X-Frame-Options": "deny"})
    calls = []
    real = bcrypt.checkpw
    monkeypatch.setattr(web_config.bcrypt, "checkpw", lambda pw, h: calls.append(h) or real(pw, h))

    def metrics(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"metrics\n"]
    app = web.guard(metrics)
    for auth in (None, "Bearer x", "Basic !!!", "Basic \u00e9t\u00e9", "Basic " + base64.b64encode(b"no-colon").decode(),
                 "Basic " + base64.b64encode(b"alice:\xff").decode(), basic("alice", "x" * 73),
                 basic("alice", "wrong"), basic("bob", "pw")):
        status, headers, body = call(app, auth)
        assert status.startswith("401") and headers["WWW-Authenticate"].startswith("Basic "), auth
        assert headers["X-Frame-Options"] == "deny" and b"metrics" not in body
    assert len(calls) == 3   # too long, the wrong password and the unknown user (against a dummy hash) reach bcrypt
    assert web.refused["unauthorized"] == 9
    for _ in range(3):
        status, headers, body = call(app, basic("alice", "pw"))
        assert status.startswith("200") and body == b"metrics\n" and headers["X-Frame-Options"] == "deny"
    assert len(calls) == 4   # bcrypt once, then the remembered digest
    assert call(app, basic("alice", "pw2"))[0].startswith("401")   # a remembered password is no other's
    assert len(calls) == 5


def test_a_silent_client_holds_up_no_scrape_and_is_closed_after_timeout_s(tmp_path, certs):
    path = tmp_path / "web.yml"
    path.write_text(tls(certs))
    web = web_config.load(str(path))

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]
    port = free_port()
    httpd, _ = web_config.serve("127.0.0.1", port, app, web, timeout_s=1.0)
    silent = socket.create_connection(("127.0.0.1", port))   # connects, never says hello
    try:
        ctx = ssl.create_default_context(cafile=certs["ca"])
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=10, context=ctx) as r:
            assert r.read() == b"ok\n"   # answered while the silent one waits in its own thread
        wait_until(lambda: web.refused["tls"] == 1, 30, what="the silent connection closed after timeout_s")
        silent.settimeout(10)
        assert silent.recv(1) == b""   # closed by the server
    finally:
        silent.close()
        httpd.shutdown()
        httpd.server_close()
