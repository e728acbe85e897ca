"""Who may talk to the collector, and as which node: mTLS identities, per-node tokens, plaintext rules
(Security; the operator's side is docs/security.md "Transport and identity").

Ingest is checked per stream after the Hello (`authorize`); the Query API and everything else on the
port (except gRPC health) needs a valid credential of the fleet (`interceptors`). Refusals are
logged with the peer and the claimed node id, at most `log_per_s` a second (the rest counted)."""

from __future__ import annotations

import hmac
import logging
import os
import stat

import grpc

from xpusense.common.config import ConfigError, split_host_port
from xpusense.common.tls import is_loopback_host

from .certs import NODE_URI_PREFIX, parse_tokens, token_hash
from .limits import RateLimitedLog

log = logging.getLogger("xpusense.collector.auth")

OPEN_SERVICES = ("/grpc.health.v1.Health/",)   # probes of orchestrators, no credentials needed
INGEST_METHOD = "/xpusense.v1.Ingest/Stream"


def _read(path: str, key: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{where}: '{key}' = {path!r}: cannot read it ({e.strerror})") from None


def _clean(s: str, n: int = 128) -> str:
    """A claimed value, safe to put in a log line (no control characters, bounded length)."""
    s = "".join(c if c.isprintable() else "?" for c in s[:n])
    return repr(s) + ("..." if len(s) >= n else "")


def cert_identities(pem: bytes) -> tuple[list[str], bool]:
    """A client certificate -> (the node ids it may report as, whether it allows client use)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    cert = x509.load_pem_x509_certificate(pem)
    client_ok = True
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client_ok = ExtendedKeyUsageOID.CLIENT_AUTH in eku or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in eku
    except x509.ExtensionNotFound:
        pass
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u[len(NODE_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                if u.startswith(NODE_URI_PREFIX)]
        dns = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        uris, dns = [], []
    if uris:          # the explicit form wins: a cert naming its node by URI is bound to that only
        return uris, client_ok
    if dns:
        return list(dns), client_ok
    # a CN's value is always a str (bytes only occur for X500UniqueIdentifier attributes)
    return [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            if isinstance(a.value, str)], client_ok


class Security:
    """The collector's transport credentials and its per-stream and per-call checks. Modes:
    - mTLS (`[tls] cert`, `key` and `ca`): every connection presents a client certificate signed by
      the CA; an agent may report only as the node its certificate names (SAN URI
      `xpusense://node/<id>`, else SAN DNS `<id>`, else subject CN `<id>`), and the certificate must
      be allowed for client use (extended key usage clientAuth, when the extension is present).
    - Tokens (`tokens_file`: `NODE_ID SHA256_HEX` lines): `authorization: Bearer <token>`, whose hash
      must be the one listed for the node id it claims. With `[tls] cert`/`key` and no `ca` the
      transport is TLS without client certificates; both can also be required together.
    - Plaintext (neither): only when the listen address is loopback, or with `allow_insecure = true`
      (a warning is logged once); otherwise the collector refuses to start, with one line naming the
      keys to set. The same holds for TLS that authenticates nobody on a non-loopback address."""

    def __init__(self, listen: str, ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None,
                 tokens: dict[str, str] | None = None, allow_insecure: bool = False, log_per_s: float = 10.0):
        self.listen = listen
        self.ca, self.cert, self.key = ca, cert, key
        self.tokens = tokens
        self.allow_insecure = allow_insecure
        self.mtls = bool(ca and cert and key)
        self.tls = bool(cert and key)
        self.refusals = 0
        self.private_files: list[tuple[str, str]] = []   # (path, key) that should be mode 0600
        self._log = RateLimitedLog(log, log_per_s)
        host, _ = split_host_port(listen)
        self.loopback = is_loopback_host(host)

    @classmethod
    def from_config(cls, cfg, where: str = "configuration") -> Security:
        """Read the files the config names; ConfigError (one line naming the key) when unusable."""
        t = cfg.tls
        if bool(t.cert) != bool(t.key):
            missing = "tls.key" if t.cert else "tls.cert"
            raise ConfigError(f"{where}: '{missing}' must be set together with "
                              f"'{'tls.cert' if t.cert else 'tls.key'}' (the collector's certificate and its key)")
        if t.ca and not t.cert:
            raise ConfigError(f"{where}: 'tls.ca' is set but 'tls.cert'/'tls.key' are not: the collector needs its "
                              f"own certificate to serve TLS (`xpusense-collector certs` makes one)")
        ca = _read(t.ca, "tls.ca", where) if t.ca else None
        cert = _read(t.cert, "tls.cert", where) if t.cert else None
        key = _read(t.key, "tls.key", where) if t.key else None
        loose = [f for f in ((t.key, "tls.key"),) if f[0]]
        tokens = None
        if cfg.tokens_file:
            text = _read(cfg.tokens_file, "tokens_file", where).decode(errors="replace")
            try:
                tokens = parse_tokens(text, cfg.tokens_file)
            except ValueError as e:
                raise ConfigError(f"{where}: 'tokens_file': {e}") from None
            loose.append((cfg.tokens_file, "tokens_file"))
        sec = cls(cfg.listen, ca, cert, key, tokens, cfg.allow_insecure)
        sec.private_files = loose
        if not sec.loopback and not sec.allow_insecure:
            if not sec.tls:
                raise ConfigError(f"{where}: 'listen' = {cfg.listen!r} is not a loopback address and no TLS is "
                                  f"configured: set [tls] cert, key and ca (`xpusense-collector certs` makes them), "
                                  f"or set allow_insecure = true to accept plaintext from the network")
            if not sec.mtls and sec.tokens is None:
                raise ConfigError(f"{where}: 'listen' = {cfg.listen!r} is not a loopback address and agents are not "
                                  f"authenticated: set [tls] ca (client certificates) or tokens_file, or set "
                                  f"allow_insecure = true to let any host report as any node")
        return sec

    def describe(self) -> str:
        parts = ["mTLS (client certificates required, node id bound to them)" if self.mtls
                 else "TLS without client certificates" if self.tls else "plaintext"]
        if self.tokens is not None:
            parts.append(f"per-node tokens ({len(self.tokens)} nodes)")
        elif not self.mtls:
            parts.append("no authentication")
        return ", ".join(parts)

    def warn_at_start(self) -> None:
        """Log the mode once (quiet in the default, plaintext on loopback); warn on plaintext from the network."""
        if self.tls or self.tokens is not None or not self.loopback:
            log.info("collector security: %s", self.describe())
        for path, key in self.private_files:
            _warn_if_readable_by_others(path, key)
        if not self.loopback and self.tls and not self.mtls and self.tokens is None:
            log.warning("NO AUTHENTICATION on non-loopback address %s (allow_insecure = true): any host can "
                        "report as any node; set [tls] ca or tokens_file for production", self.listen)
        if not self.tls and not self.loopback:
            log.warning("PLAINTEXT on non-loopback address %s (allow_insecure = true): telemetry%s travels in "
                        "clear and %s; configure [tls] for production", self.listen,
                        " and tokens" if self.tokens is not None else "",
                        "tokens can be sniffed" if self.tokens is not None else "any host can report as any node")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mtls)

    # -- checks
    def _refuse_log(self, peer: str, node_id: str, why: str) -> None:
        self.refusals += 1
        self._log.warning("refused stream from %s claiming node %s: %s", peer, _clean(node_id), why)

    async def authorize(self, context: grpc.aio.ServicerContext, node_id: str) -> None:
        """Abort the stream unless its credentials allow reporting as `node_id` (logs the refusal)."""
        peer = context.peer()
        if self.mtls:
            code, why = self._check_cert(context, node_id)
            if code is not None:
                self._refuse_log(peer, node_id, why)
                await context.abort(code, why)
        if self.tokens is not None:
            code, why = self._check_token(context.invocation_metadata(), node_id)
            if code is not None:
                self._refuse_log(peer, node_id, why)
                await context.abort(code, why)

    def _check_cert(self, context, node_id: str) -> tuple[grpc.StatusCode | None, str]:
        auth = context.auth_context() or {}
        pems = auth.get("x509_pem_cert") or []
        if not pems:
            return grpc.StatusCode.UNAUTHENTICATED, "no client certificate"
        try:
            ids, client_ok = cert_identities(pems[0])
        except Exception as e:   # a certificate the CA signed but cryptography cannot read
            return grpc.StatusCode.UNAUTHENTICATED, f"unreadable client certificate ({type(e).__name__})"
        if not client_ok:
            return grpc.StatusCode.PERMISSION_DENIED, "the certificate is not for client use (extended key usage)"
        if node_id not in ids:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"the client certificate is for node {', '.join(map(_clean, ids)) or '(none)'}, "
                    f"not {_clean(node_id)}")
        return None, ""

    def _token_of(self, metadata) -> str | None:
        for k, v in metadata or ():
            if k == "authorization":
                v = v.decode(errors="replace") if isinstance(v, bytes) else v
                scheme, _, tok = v.partition(" ")
                return tok.strip() if scheme.lower() == "bearer" else None
        return None

    def _check_token(self, metadata, node_id: str) -> tuple[grpc.StatusCode | None, str]:
        tok = self._token_of(metadata)
        if not tok:
            return grpc.StatusCode.UNAUTHENTICATED, "no bearer token (authorization metadata)"
        h = token_hash(tok)
        assert self.tokens is not None   # only called when tokens are configured
        want = self.tokens.get(node_id)
        if want is not None and hmac.compare_digest(h, want):
            return None, ""
        if any(hmac.compare_digest(h, w) for w in self.tokens.values()):
            return grpc.StatusCode.PERMISSION_DENIED, f"the token is not the one of node {_clean(node_id)}"
        return grpc.StatusCode.UNAUTHENTICATED, "invalid token"

    def token_valid(self, metadata) -> bool:
        tok = self._token_of(metadata)
        if not tok:
            return False
        h = token_hash(tok)
        assert self.tokens is not None   # the token interceptor exists only when tokens are configured
        return any(hmac.compare_digest(h, w) for w in self.tokens.values())

    def interceptors(self) -> list:
        """Server interceptors: with tokens, every call but health needs a valid token of the fleet."""
        return [_TokenInterceptor(self)] if self.tokens is not None else []


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, sec: Security):
        self.sec = sec

    async def intercept_service(self, continuation, details):
        method = details.method or ""
        # Ingest is checked after its Hello by `authorize`, which knows the node id claimed.
        if (method.startswith(OPEN_SERVICES) or method == INGEST_METHOD
                or self.sec.token_valid(details.invocation_metadata)):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        why = "a valid bearer token is needed (authorization metadata)"

        async def deny(request_or_iterator, context):
            self.sec._log.warning("refused %s call from %s: %s", method, context.peer(), why)
            self.sec.refusals += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        async def deny_stream(request_or_iterator, context):
            await deny(request_or_iterator, context)
            yield  # pragma: no cover  (abort raises)

        kinds = (handler.request_streaming, handler.response_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[kinds]
        fn = deny_stream if handler.response_streaming else deny
        return make(fn, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def _warn_if_readable_by_others(path: str, key: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is readable by group or others (mode %o): chmod 600 it", key, path, mode & 0o777)
