"""TLS and basic auth on a /metrics endpoint from a Prometheus web-config file (exporter-toolkit's
format, `--web-config-file`): the file loaded and checked with errors naming its key, the TLS
context, bcrypt-checked users (a verified password is remembered as a digest, so a scrape costs no
bcrypt), the response headers, and the threaded HTTP server that serves prometheus_client's app
behind them, each TLS handshake on the connection's own thread within `timeout_s`."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import logging
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import bcrypt
import yaml

from xpusense.common.config import ConfigError

__all__ = ["WebConfig", "add_web_config_flag", "check_file", "load", "serve", "web_config_flags"]

log = logging.getLogger("xpusense.collector.web_config")

KEY = "export.prometheus.web_config_file"
MAX_FILE_BYTES = 1 << 20
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
            "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# Go's tls.ClientAuthType names. Python's ssl cannot take a client certificate it does not verify,
# so RequestClientCert and RequireAnyClientCert (both unverified, "insecure" in exporter-toolkit's
# words) are refused.
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
# exporter-toolkit's http_server_config.headers, with the values it accepts where it restricts them.
HEADERS: dict[str, tuple[str, ...]] = {"Content-Security-Policy": (), "X-Frame-Options": ("deny", "sameorigin"),
                                       "X-Content-Type-Options": ("nosniff",), "X-XSS-Protection": (),
                                       "Strict-Transport-Security": ()}
UNSUPPORTED = {"tls_server_config": ("cert", "key", "client_ca", "cipher_suites", "curve_preferences",
                                     "client_allowed_sans"),
               "": ("rate_limit",)}
KNOWN = {"": ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"),
         "tls_server_config": ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
                               "max_version", "prefer_server_cipher_suites", *UNSUPPORTED["tls_server_config"]),
         "http_server_config": ("http2", "headers")}
REASONS = ("unauthorized", "tls", "connection")
BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}$")
# Unknown users are checked against this, so they take as long as a wrong password (cost 10).
DUMMY_HASH = b"$2b$10$g7D50tY7dxt03Yh2TefQ.O0mpARUJcB8bKtkfR7TJN5ZZLLF9JztK"


@dataclasses.dataclass(eq=False)
class WebConfig:
    path: str
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = dataclasses.field(default_factory=dict)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    verified: dict[str, bytes] = dataclasses.field(default_factory=dict)   # user -> digest of the last good password
    refused: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def check_user(self, user: str, password: str) -> bool:
        """Whether `user:password` is allowed: bcrypt the first time, a constant-time digest compare after."""
        digest = hashlib.sha256(f"{self.path}\0{user}\0{password}".encode()).digest()
        known = self.verified.get(user)
        if known is not None and hmac.compare_digest(known, digest):
            return True
        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password.encode(), hashed if hashed is not None else DUMMY_HASH) and hashed is not None
        except ValueError:   # over bcrypt's 72 bytes
            return False
        if ok:   # one entry per user of the file: bounded by the file
            self.verified[user] = digest
        return ok

    def guard(self, app: Callable) -> Callable:
        """The WSGI app behind basic auth (when the file has users) and with the file's headers."""
        extra = list(self.headers.items())

        def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
            def respond(status: str, headers: list, exc_info: Any = None) -> Any:
                return start_response(status, headers + extra, exc_info)
            if self.users and not self._authorized(environ.get("HTTP_AUTHORIZATION", "")):
                _count(self, "unauthorized")
                respond("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="xpusense"'),
                                             ("Content-Type", "text/plain; charset=utf-8")])
                return [b"Unauthorized\n"]
            return app(environ, respond)
        return guarded

    def _authorized(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except ValueError:   # not base64 (binascii.Error), not ASCII, not UTF-8
            return False
        return bool(sep) and self.check_user(user, password)

    def collect(self) -> Iterator[Any]:
        """The refusals as a counter family (a prometheus_client custom collector)."""
        from prometheus_client.core import CounterMetricFamily
        fam = CounterMetricFamily("xpusense_collector_prometheus_refused",
                                  "Requests to /metrics refused: unauthorized (401), a failed TLS handshake, "
                                  "or a connection that broke or was silent past timeout_s.", labels=["reason"])
        for reason, n in self.refused.items():
            fam.add_metric([reason], n)
        yield fam


def _bad(path: str, key: str, why: str) -> ConfigError:
    return ConfigError(f"web-config file {path}: '{key}' {why}")


def _table(path: str, data: Any, section: str) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _bad(path, section or "(top level)", "must be a mapping")
    for k in data:
        if k not in KNOWN[section]:
            name = f"{section}.{k}" if section else str(k)
            raise _bad(path, name, f"is not a web-config key (known here: {', '.join(KNOWN[section])})")
        if k in UNSUPPORTED.get(section, ()):
            name = f"{section}.{k}" if section else str(k)
            hint = "; give cert_file, key_file, client_ca_file" if section else ""
            raise _bad(path, name, f"is not supported by xpusense's /metrics endpoint; leave it out{hint}")
    return data


def _str(path: str, t: dict, section: str, key: str, default: str = "") -> str:
    v = t.get(key, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(path, f"{section}.{key}", f"must be a string, got {v!r}")
    return v


def _tls(path: str, t: dict) -> ssl.SSLContext:
    s = "tls_server_config"
    cert, key = _str(path, t, s, "cert_file"), _str(path, t, s, "key_file")
    if not cert or not key:
        raise _bad(path, f"{s}.{'key_file' if cert else 'cert_file'}", "is required when tls_server_config is given")
    auth = _str(path, t, s, "client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        raise _bad(path, f"{s}.client_auth_type", f"must be {', '.join(CLIENT_AUTH)}, got {auth!r} (a client "
                   "certificate that is not verified is not supported)")
    ca = _str(path, t, s, "client_ca_file")
    if ca and auth == "NoClientCert":
        raise _bad(path, f"{s}.client_ca_file", "is given but client_auth_type is NoClientCert: set client_auth_type "
                   "to RequireAndVerifyClientCert")
    if auth != "NoClientCert" and not ca:
        raise _bad(path, f"{s}.client_ca_file", f"is required with client_auth_type {auth}")
    low, high = (_str(path, t, s, k, d) for k, d in (("min_version", "TLS12"), ("max_version", "TLS13")))
    for k, v in (("min_version", low), ("max_version", high)):
        if v not in VERSIONS:
            raise _bad(path, f"{s}.{k}", f"must be {', '.join(VERSIONS)}, got {v!r}")
    if VERSIONS[low] > VERSIONS[high]:
        raise _bad(path, f"{s}.min_version", f"{low} is above max_version {high}")
    prefer = t.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise _bad(path, f"{s}.prefer_server_cipher_suites", f"must be true or false, got {prefer!r}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version, ctx.maximum_version = VERSIONS[low], VERSIONS[high]
    if prefer:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise _bad(path, f"{s}.cert_file", f"{cert!r} with key_file {key!r} cannot be loaded "
                   f"({getattr(e, 'strerror', None) or e})") from None
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise _bad(path, f"{s}.client_ca_file", f"{ca!r} cannot be loaded ({getattr(e, 'strerror', None) or e})"
                       ) from None
    ctx.verify_mode = CLIENT_AUTH[auth]
    return ctx


def load(path: str) -> WebConfig:
    """The checked web-config file; ConfigError names the file and the key that is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"web-config file {path}: cannot read it ({e.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"web-config file {path}: over {MAX_FILE_BYTES} bytes; not a web-config file")
    try:
        data = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"web-config file {path}: not valid YAML: {e}") from None
    top = _table(path, data, "")
    web = WebConfig(path)
    if top.get("tls_server_config") is not None:
        web.ssl_context = _tls(path, _table(path, top["tls_server_config"], "tls_server_config"))
    http = _table(path, top.get("http_server_config"), "http_server_config")
    if not isinstance(http.get("http2", True), bool):
        raise _bad(path, "http_server_config.http2", f"must be true or false, got {http['http2']!r}")
    web.headers = _headers(path, http.get("headers") or {})
    web.users = _users(path, top.get("basic_auth_users") or {})
    return web


def _headers(path: str, headers: Any) -> dict[str, str]:
    out = {}
    if not isinstance(headers, dict):
        raise _bad(path, "http_server_config.headers", "must be a mapping of header name to value")
    for name, value in headers.items():
        if name not in HEADERS:
            raise _bad(path, f"http_server_config.headers.{name}", f"is not one of {', '.join(HEADERS)}")
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise _bad(path, f"http_server_config.headers.{name}", f"must be a one-line string, got {value!r}")
        if HEADERS[name] and value.lower() not in HEADERS[name]:
            raise _bad(path, f"http_server_config.headers.{name}", f"must be {' or '.join(HEADERS[name])}, "
                       f"got {value!r}")
        if value:
            out[name] = value
    return out


def _users(path: str, users: Any) -> dict[str, bytes]:
    out = {}
    if not isinstance(users, dict):
        raise _bad(path, "basic_auth_users", "must be a mapping of user name to bcrypt hash")
    for user, hashed in users.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise _bad(path, f"basic_auth_users.{user}", "must be a user name without ':'")
        if not isinstance(hashed, str) or not BCRYPT.match(hashed):
            raise _bad(path, f"basic_auth_users.{user}", "must be a bcrypt hash such as `htpasswd -nBC 10 \"\" | "
                       "tr -d ':\\n'` prints ($2y$10$ and 53 characters)")
        out[user] = hashed.encode()
    return out


def check_file(path: str) -> str | None:
    """The config schema's check of web_config_file: the file's first error, or None."""
    if not path:
        return None
    try:
        load(path)
    except ConfigError as e:
        return f"names a bad file: {e}"
    return None


def serve(host: str, port: int, app: Callable, web: WebConfig | None, timeout_s: float) -> tuple[Any, threading.Thread]:
    """A threaded HTTP(S) server of `app` on a daemon thread (as prometheus_client's start_http_server):
    a connection's TLS handshake and request head are read on its own thread within `timeout_s`, so
    a silent client holds up no other scrape; OSError when the address cannot be had."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Handler(WSGIRequestHandler):
        timeout = timeout_s

        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes are not logged."""

    ctx = web.ssl_context if web is not None else None

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

        def finish_request(self, request: Any, client_address: Any) -> None:
            if ctx is None:
                return super().finish_request(request, client_address)
            request.settimeout(timeout_s)
            try:
                tls = ctx.wrap_socket(request, server_side=True)
            except (OSError, ValueError) as e:   # not TLS, a bad or missing client certificate, too slow
                _count(web, "tls")
                log.debug("TLS handshake with %s failed: %s", client_address, e)
                return
            try:
                super().finish_request(tls, client_address)
            finally:
                tls.close()

        def handle_error(self, request: Any, client_address: Any) -> None:
            """A connection that broke or said nothing within timeout_s: counted, not a traceback."""
            _count(web, "connection")
            log.debug("connection from %s to /metrics failed", client_address, exc_info=True)

    httpd = make_server(host, port, web.guard(app) if web is not None else app, Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="prometheus-http", daemon=True)
    thread.start()
    return httpd, thread


def _count(web: WebConfig | None, reason: str) -> None:
    if web is not None:
        with web.lock:
            web.refused[reason] += 1


def add_web_config_flag(p: Any) -> None:
    p.add_argument("--web-config-file", metavar="PATH",
                   help="TLS and basic auth for /metrics: a Prometheus web-config file ([export.prometheus] "
                        "web_config_file; docs/export.md)")


def web_config_flags(args: Any) -> dict:
    """The config flag `--web-config-file PATH` sets."""
    path = getattr(args, "web_config_file", None)
    return {KEY: path} if path else {}
