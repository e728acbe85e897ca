"""How the agent (and the collector's query CLI) reach the collector: mTLS, TLS + token, or
plaintext (make_channel). Unusable settings raise ConfigError naming the key (the CLI exits 2)."""

from __future__ import annotations

import ipaddress
import logging
import socket

import grpc

from .config import ConfigError, split_host_port

log = logging.getLogger("xpusense.tls")


def is_loopback_host(host: str) -> bool:
    """True when every address `host` names is a loopback address ('' and wildcards are not)."""
    host = host.strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    # RFC 6761: "localhost" and names under ".localhost" are loopback, whatever (or whether) the
    # host's resolver is configured; a host without /etc/hosts must not turn them into "remote".
    if host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    addrs = {str(i[4][0]) for i in infos}   # an IPv4/IPv6 sockaddr's host: already a str
    return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)


CONFIG_NAMES = {**{k: f"collector.{k}" for k in ("address", "tls_ca", "tls_cert", "tls_key", "token_file")},
                "insecure": "collector.insecure = true"}


def _read(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"'{name}' = {path!r}: cannot read it ({e.strerror})") from None


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                         grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (plaintext channels refuse call credentials)."""

    def __init__(self, token: str):
        self.md = ("authorization", f"Bearer {token}")

    def _details(self, d):
        md = list(d.metadata or []) + [self.md]
        return _Details(d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]


def channel_options(backoff_initial_s: float = 0.2, backoff_max_s: float = 10.0,
                    connect_timeout_s: float | None = None) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS plus gRPC's own reconnect backoff bounded like ours: left at its defaults
    (up to 120 s), a channel that failed for a while does not even try to connect when our loop
    asks it to, and an agent found its collector a minute after it was back.
    `connect_timeout_s`: how long one connection attempt may take (gRPC's min_reconnect_backoff is
    also its minimum connect deadline: at backoff_initial_s, a handshake with a busy collector
    timed out, and an agent failing over gave up on a live gateway); None: backoff_initial_s.
    No BDP probing on the agent's stream: it sizes a channel's receive window for bulk replies by
    pinging the peer as data comes in, each probe a ping and its ack (a wake-up of the event engine's
    threads on both sides), and all the agent receives is a small Ack a second. Query clients keep
    it: a page of ListNodes or GetHistory across regions needs the window it grows."""
    return CHANNEL_OPTIONS + [
        ("grpc.http2.bdp_probe", 0),
        ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff_initial_s * 1000))),
        ("grpc.min_reconnect_backoff_ms", max(1, int((connect_timeout_s or backoff_initial_s) * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, int(backoff_max_s * 1000))),
    ]


class ChannelFactory:
    """Makes gRPC channels to one collector, as make_channel() configured them; `mode` says how
    they connect ("plaintext", "TLS", "mTLS", each possibly "+ token")."""

    def __init__(self, address: str, options: list, names: dict[str, str], loopback: bool,
                 ca: bytes | None, cert: bytes | None, key: bytes | None, token: str | None):
        self.address = address
        self.options = options
        self.names = names
        self.loopback = loopback
        self.ca, self.cert, self.key, self.token = ca, cert, key, token
        self.tls = bool(ca or cert)
        self.mode = ("mTLS" if cert else "TLS" if self.tls else "plaintext") + (" + token" if token else "")
        self._warned = False

    def __call__(self) -> grpc.Channel:
        address, options, token, n = self.address, self.options, self.token, self.names
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                 certificate_chain=self.cert)
            if token:
                creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
            return grpc.secure_channel(address, creds, options=options)
        if not self.loopback and not self._warned:
            self._warned = True
            log.warning("PLAINTEXT to collector %s (%s): telemetry%s travels in clear; set %s for production",
                        address, n["insecure"], " and this node's token" if token else "", n["tls_ca"])
        ch = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(ch, _BearerInterceptor(token)) if token else ch


def make_channel(address: str, collector_cfg, options: list | None = None,
                 names: dict[str, str] | None = None) -> ChannelFactory:
    """Check the [collector] security keys now; return a factory of channels to `address` (for
    StreamClient's `channel` parameter):
    - `tls_ca` (and/or `tls_cert` + `tls_key`): TLS, the collector's certificate checked against
      `tls_ca` (the system's roots when unset); with `tls_cert`/`tls_key` the agent presents its
      client certificate (mTLS), which names the node it may report as.
    - `token_file`: the node's bearer token, `authorization: Bearer ...` on every call (call
      credentials over TLS; plain metadata over plaintext, which only loopback or `insecure` allows).
    - neither: plaintext, allowed only to a loopback collector unless `insecure = true` (then a
      warning says so when the first channel is made).

    `names`: how errors call each setting (default the config keys; the query CLI passes its flags)."""
    c = collector_cfg
    n = names or CONFIG_NAMES
    get = lambda k, d="": getattr(c, k, d) or d  # noqa: E731  (older configs lack the keys)
    ca_path, cert_path, key_path = get("tls_ca"), get("tls_cert"), get("tls_key")
    token_path, insecure = get("token_file"), bool(getattr(c, "insecure", False))
    if bool(cert_path) != bool(key_path):
        have, missing = ("tls_cert", "tls_key") if cert_path else ("tls_key", "tls_cert")
        raise ConfigError(f"'{n[missing]}' must be set together with '{n[have]}' "
                          f"(this node's certificate and its private key)")
    ca = _read(ca_path, n["tls_ca"]) if ca_path else None
    cert = _read(cert_path, n["tls_cert"]) if cert_path else None
    key = _read(key_path, n["tls_key"]) if key_path else None
    token = None
    if token_path:
        token = _read(token_path, n["token_file"]).decode(errors="replace").strip()
        if not token or any(ch.isspace() for ch in token):
            raise ConfigError(f"'{n['token_file']}' = {token_path!r}: expected one token on one line")
    tls = bool(ca or cert)
    host, _ = split_host_port(address)
    loopback = is_loopback_host(host)
    if not tls and not loopback and not insecure:
        raise ConfigError(f"'{n['address']}' = {address!r} is not a loopback address and no TLS is configured: "
                          f"set {n['tls_ca']} (and {n['tls_cert']}/{n['tls_key']} for mTLS), or {n['insecure']} "
                          f"to send in clear")
    if options is None:
        options = CHANNEL_OPTIONS
    return ChannelFactory(address, options, n, loopback, ca, cert, key, token)
