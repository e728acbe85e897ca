"""The HTTP endpoint of kube-scheduler's extender (`[kubernetes.extender]`, `--extender-listen`): POST
/filter and /prioritize on the event loop that owns the fleet state (as the gRPC server is: no
thread contends with it for the interpreter), each decision in one go as Place's. TLS and the
fleet's tokens as on the gRPC port; bounded heads, bodies and connections, each bound counted."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from collections import Counter
from typing import Any

from xpusense.common.config import ConfigError, split_host_port
from xpusense.common.tls import is_loopback_host

from .grpc_server import BindError
from .scheduler.core import Scheduler
from .scheduler.extender import filter_result, priorities
from .scheduler.verdict_cache import VerdictCache

log = logging.getLogger("xpusense.collector.extender")

VERBS = {"/filter": filter_result, "/prioritize": priorities}
KEY = "kubernetes.extender"
MAX_HEAD_BYTES = 64 * 1024          # request line and headers
PARSE_ON_LOOP_BYTES = 1 << 20       # bodies above this are parsed on a thread


def check_section(cfg: Any, where: str) -> None:
    """Plaintext on a non-loopback extender address needs TLS or allow_insecure, as `listen` does."""
    ext = cfg.kubernetes.extender
    host, _ = split_host_port(ext.listen)
    if ext.enabled and not is_loopback_host(host) and not cfg.tls.cert and not cfg.allow_insecure:
        raise ConfigError(f"{where}: '{KEY}.listen' = {ext.listen!r} is not a loopback address and no TLS is "
                          f"configured: set [tls] cert and key (and ca for client certificates), or "
                          f"allow_insecure = true")


class ExtenderServer:
    """The endpoint over a scheduler core, on the event loop that owns the fleet state. `cfg`: the
    collector's loaded config; `security`: its collector.auth.Security (tokens) or None; `counters`:
    where requests, refusals and the bounds' hits are counted."""

    def __init__(self, core: Scheduler, cfg: Any, security: Any = None, counters: Counter | None = None):
        self.core, self.section, self.security = core, cfg.kubernetes.extender, security
        self.tls = cfg.tls
        self.counters: Counter = counters if counters is not None else Counter()
        self.server: asyncio.base_events.Server | None = None
        self.open = 0   # connections open now (max_connections)
        # every node's verdict per request shape, kept up to date (scheduler/verdict_cache.py)
        self.cache = VerdictCache(self.section.verdict_shapes, self.counters)
        self.address = ""

    async def start(self) -> None:
        """Bind and serve on the running loop. OSError when the address is unusable."""
        host, port = split_host_port(self.section.listen)
        ctx = None
        if self.tls.cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.tls.cert, self.tls.key)
            if self.tls.ca:
                ctx.load_verify_locations(self.tls.ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        self.server = await asyncio.start_server(self._connection, host, port, ssl=ctx, limit=MAX_HEAD_BYTES,
                                                 ssl_handshake_timeout=float(self.section.timeout_s) if ctx else None)
        self.address = f"{host}:{self.server.sockets[0].getsockname()[1]}"
        log.info("kube-scheduler extender on %s://%s/ (filter, prioritize)", "https" if ctx else "http", self.address)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.open >= self.section.max_connections:
                self.counters[f"{KEY}.max_connections"] += 1
                await _respond(writer, 503, f"{KEY}.max_connections connections open; retry\n", False)
                return
            self.open += 1
            try:
                while await self._request(reader, writer):
                    pass
            finally:
                self.open -= 1
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, TimeoutError):
            pass   # the peer went away or fell silent: nothing to answer
        finally:
            writer.close()

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; False when the connection is to be closed."""
        timeout = float(self.section.timeout_s)
        try:   # asyncio.timeout, not wait_for: no task of its own, no extra loop turns behind the ingest
            async with asyncio.timeout(timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        except asyncio.LimitOverrunError:
            self.counters[f"{KEY}.refused"] += 1
            await _respond(writer, 431, f"request head over {MAX_HEAD_BYTES} bytes\n", False)
            return False
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, path, version = lines[0].split(" ", 2)
        except ValueError:
            self.counters[f"{KEY}.refused"] += 1
            await _respond(writer, 400, "not an HTTP request\n", False)
            return False
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        self.counters[f"{KEY}.requests"] += 1
        code, body, more = await self._answer(method, path, headers, reader)
        keep = keep and more
        view = self.core.view
        if code == 200:
            view.serve_begin()   # the bulk refresh waits for the answer to leave, as for a Place call (fleet.py)
        try:
            await _respond(writer, code, body, keep)
        finally:
            if code == 200:
                view.serve_end()
        return keep

    async def _answer(self, method: str, path: str, headers: dict, reader: asyncio.StreamReader,
                      ) -> tuple[int, Any, bool]:
        """(status, body: JSON-able, or text ending in a newline, whether the connection can go on)."""
        verb = VERBS.get(path.split("?", 1)[0].rstrip("/") or "/")
        if method != "POST" or verb is None:
            self.counters[f"{KEY}.refused"] += 1
            return 404 if method == "POST" else 405, "POST /filter or /prioritize (kube-scheduler's extender)\n", False
        sec = self.security
        if sec is not None and sec.tokens is not None and not sec.mtls:
            if not sec.token_valid([("authorization", headers.get("authorization", ""))]):
                sec.refusals += 1
                self.counters[f"{KEY}.refused"] += 1
                return 401, "a valid bearer token of the fleet is needed (Authorization)\n", False
        length = headers.get("content-length", "")
        if not length.isdigit():
            self.counters[f"{KEY}.refused"] += 1
            return 411, "Content-Length is needed\n", False
        limit = self.section.max_request_bytes
        if int(length) > limit:
            self.counters[f"{KEY}.max_request_bytes"] += 1
            await _discard(reader, int(length), float(self.section.timeout_s))   # so that the sender reads the 413
            return 413, f"body of {length} bytes is over {KEY}.max_request_bytes = {limit}\n", False
        async with asyncio.timeout(float(self.section.timeout_s)):
            body = await reader.readexactly(int(length))
        try:   # a large body (the Nodes form) is parsed off the loop
            doc = (json.loads(body) if len(body) <= PARSE_ON_LOOP_BYTES
                   else await asyncio.get_running_loop().run_in_executor(None, json.loads, body))
        except (ValueError, RecursionError) as e:
            self.counters[f"{KEY}.errors"] += 1
            return 400, f"the body is not JSON ({e})\n", True
        try:
            out = verb(self.core, doc, self.cache)   # on the loop that owns the state, in one go
        except ValueError as e:   # prioritize's unreadable request, ExtenderError or the core's PlaceError
            self.counters[f"{KEY}.errors"] += 1
            return 400, f"{e}\n", True
        if isinstance(out, dict) and out.get("Error"):
            self.counters[f"{KEY}.errors"] += 1
        return 200, out, True


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           411: "Length Required", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


async def _discard(reader: asyncio.StreamReader, n: int, timeout_s: float) -> None:
    """Read and drop up to `n` bytes, for at most `timeout_s` (nothing is kept)."""
    try:
        async with asyncio.timeout(timeout_s):
            while n > 0 and (chunk := await reader.read(min(n, 1 << 16))):
                n -= len(chunk)
    except TimeoutError:
        pass


async def _respond(writer: asyncio.StreamWriter, code: int, body: Any, keep: bool) -> None:
    """The status line, headers and body in one write."""
    text = isinstance(body, str)
    data = (body if text else json.dumps(body, separators=(",", ":"))).encode()
    close = "" if keep else "Connection: close\r\n"
    head = (f"HTTP/1.1 {code} {REASONS.get(code, '')}\r\nServer: xpusense-extender\r\n"
            f"Content-Type: {'text/plain; charset=utf-8' if text else 'application/json'}\r\n"
            f"Content-Length: {len(data)}\r\n{close}\r\n")
    writer.write(head.encode() + data)
    await writer.drain()


async def start_extender(cfg: Any, core: Scheduler, security: Any = None, counters: Counter | None = None,
                         ) -> ExtenderServer | None:
    """The extender over `core` when `[kubernetes.extender] enabled` (on the running loop); None
    when off. BindError (collector/grpc_server.py) when its address cannot be bound."""
    if cfg is None or not cfg.kubernetes.extender.enabled:
        return None
    ext = ExtenderServer(core, cfg, security, counters)
    try:
        await ext.start()
    except OSError as e:
        raise BindError(f"cannot serve the extender on {KEY}.listen = {cfg.kubernetes.extender.listen!r} "
                        f"({e.strerror or e}); free it or set --extender-listen") from None
    return ext


def extender_flags(args: Any) -> dict:
    """The config flags `--extender-listen HOST:PORT` sets (it also turns the extender on)."""
    listen = getattr(args, "extender_listen", None)
    return {f"{KEY}.listen": listen, f"{KEY}.enabled": True} if listen else {}


def add_extender_flag(p: Any) -> None:
    p.add_argument("--extender-listen", metavar="HOST:PORT",
                   help=f"serve kube-scheduler's extender (POST /filter, /prioritize) here ([{KEY}])")
