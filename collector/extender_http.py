"""The HTTP endpoint of kube-scheduler's extender (`[kubernetes.extender]`, `--extender-listen`): POST
/filter and /prioritize on the event loop that owns the fleet state (as the gRPC server is: no
thread contends with it for the interpreter), each request answered in the loop turn that reads its
last bytes (an asyncio.Protocol: no further turns behind the ingest). TLS and the fleet's tokens as
on the gRPC port; bounded heads, bodies and connections, each bound counted; HTTP/1.1 keep-alive."""

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
from .scheduler.extender import NO_ERROR, filter_reply, priorities_reply
from .scheduler.verdict_cache import VerdictCache

log = logging.getLogger("xpusense.collector.extender")

VERBS = {"/filter": filter_reply, "/prioritize": priorities_reply}
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
        # every node's verdict per request shape, and its replies per list of names, kept up to date
        # (scheduler/verdict_cache.py)
        self.cache = VerdictCache(self.section.verdict_shapes, self.counters, self.section.name_lists)
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
        self.server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), host, port, ssl=ctx,
            ssl_handshake_timeout=float(self.section.timeout_s) if ctx else None)
        self.address = f"{host}:{self.server.sockets[0].getsockname()[1]}"
        log.info("kube-scheduler extender on %s://%s/ (filter, prioritize)", "https" if ctx else "http", self.address)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def refusal(self, method: str, path: str, headers: dict) -> tuple[int, str] | None:
        """(status, why) when a request's head is refused (its body is then not read), else None."""
        if method != "POST" or VERBS.get(path.split("?", 1)[0].rstrip("/") or "/") is None:
            self.counters[f"{KEY}.refused"] += 1
            return 404 if method == "POST" else 405, "POST /filter or /prioritize (kube-scheduler's extender)\n"
        sec = self.security
        if sec is not None and sec.tokens is not None and not sec.mtls:
            if not sec.token_valid([("authorization", headers.get("authorization", ""))]):
                sec.refusals += 1
                self.counters[f"{KEY}.refused"] += 1
                return 401, "a valid bearer token of the fleet is needed (Authorization)\n"
        if not headers.get("content-length", "").isdigit():
            self.counters[f"{KEY}.refused"] += 1
            return 411, "Content-Length is needed\n"
        return None

    def answer(self, path: str, body: bytes, doc: Any = None) -> tuple[int, str | bytes]:
        """(status, body: JSON as bytes, or text ending in a newline) of a request that passed refusal().
        `doc`: the body already parsed (or the error parsing it raised), else parsed here."""
        verb = VERBS[path.split("?", 1)[0].rstrip("/") or "/"]
        try:
            if doc is None:
                doc = json.loads(body)
            elif isinstance(doc, Exception):
                raise doc
        except (ValueError, RecursionError) as e:
            self.counters[f"{KEY}.errors"] += 1
            return 400, f"the body is not JSON ({e})\n"
        try:
            out = verb(self.core, doc, self.cache)   # on the loop that owns the state, in one go
        except ValueError as e:   # prioritize's unreadable request, ExtenderError or the core's PlaceError
            self.counters[f"{KEY}.errors"] += 1
            return 400, f"{e}\n"
        if out.startswith("{") and not out.endswith(NO_ERROR):   # a filter reply with Error set
            self.counters[f"{KEY}.errors"] += 1
        return 200, out.encode()


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           411: "Length Required", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


def _response(code: int, body: str | bytes, keep: bool) -> bytes:
    """The status line, headers and body of one answer: `body` text, or JSON as bytes."""
    text = isinstance(body, str)
    data = body.encode() if isinstance(body, str) else body
    close = "" if keep else "Connection: close\r\n"
    head = (f"HTTP/1.1 {code} {REASONS.get(code, '')}\r\nServer: xpusense-extender\r\n"
            f"Content-Type: {'text/plain; charset=utf-8' if text else 'application/json'}\r\n"
            f"Content-Length: {len(data)}\r\n{close}\r\n")
    return head.encode() + data


class _Connection(asyncio.Protocol):
    """One client connection: data_received parses each request as its bytes arrive and, once its
    body is complete, answers it in that same callback (one loop turn, none queued behind the
    ingest). Buffered bytes stay under the head and body bounds; HTTP/1.1 keep-alive."""

    def __init__(self, server: ExtenderServer):
        self.srv = server
        self.transport: Any = None
        self.buf = bytearray()
        self.head: tuple[str, str, dict, bool] | None = None   # method, path, headers, keep-alive
        self.need = 0          # the body's length, once the head is read
        self.discard = 0       # bytes of an oversized body still to drop before its 413
        self.counted = False   # counted in ExtenderServer.open
        self.busy = False      # a large body is being parsed off the loop
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        srv = self.srv
        if srv.open >= srv.section.max_connections:
            srv.counters[f"{KEY}.max_connections"] += 1
            self._respond(503, f"{KEY}.max_connections connections open; retry\n", False)
            return
        srv.open += 1
        self.counted = True
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.srv.open -= 1
            self.counted = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def pause_writing(self) -> None:   # the peer reads slowly: take no more requests from it until it does
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.busy:
            self.transport.resume_reading()

    def _arm(self) -> None:
        """(Re)start the wait of `timeout_s` for the next part of a request."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(float(self.srv.section.timeout_s), self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.discard:   # the oversized body's sender stopped: answer it anyway
            self.discard = 0
            self._refuse_oversized()
        elif not self.busy:
            self.transport.close()   # the peer fell silent: nothing to answer

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.discard:
            self.discard -= min(self.discard, len(data))
            if not self.discard:
                self._refuse_oversized()
            return
        self.buf += data
        while not self.busy and not self.transport.is_closing() and self._step():
            pass

    def _step(self) -> bool:
        """Take what the buffer holds of the request under way; True when there may be more to take."""
        buf, srv = self.buf, self.srv
        if self.head is None:
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    srv.counters[f"{KEY}.refused"] += 1
                    self._respond(431, f"request head over {MAX_HEAD_BYTES} bytes\n", False)
                return False
            lines = buf[:end].decode("latin-1").split("\r\n")
            del buf[:end + 4]
            try:
                method, path, version = lines[0].split(" ", 2)
            except ValueError:
                srv.counters[f"{KEY}.refused"] += 1
                self._respond(400, "not an HTTP request\n", False)
                return False
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
            srv.counters[f"{KEY}.requests"] += 1
            refusal = srv.refusal(method, path, headers)
            if refusal is not None:
                self._respond(*refusal, False)
                return False
            length = int(headers["content-length"])
            if length > srv.section.max_request_bytes:
                srv.counters[f"{KEY}.max_request_bytes"] += 1
                self.head, self.need = (method, path, headers, keep), length
                self.discard = max(0, length - len(buf))   # read and dropped so that the sender reads the 413
                buf.clear()
                if not self.discard:
                    self._refuse_oversized()
                else:
                    self._arm()
                return False
            self.head, self.need = (method, path, headers, keep), length
            self._arm()   # the body's own wait
        if len(buf) < self.need:
            return False
        body = bytes(buf[:self.need])
        del buf[:self.need]
        _, path, _, keep = self.head
        self.head = None
        if len(body) > PARSE_ON_LOOP_BYTES:   # a large body (the Nodes form) is parsed off the loop
            self.busy = True
            self.transport.pause_reading()
            asyncio.get_running_loop().create_task(self._answer_large(path, body, keep))
            return False
        self._finish(srv.answer(path, body), keep)
        return True

    async def _answer_large(self, path: str, body: bytes, keep: bool) -> None:
        try:
            doc: Any = await asyncio.get_running_loop().run_in_executor(None, json.loads, body)
        except (ValueError, RecursionError) as e:
            doc = e
        self.busy = False
        if self.transport.is_closing():
            return
        self._finish(self.srv.answer(path, body, doc), keep)
        self.transport.resume_reading()
        while not self.busy and not self.transport.is_closing() and self._step():
            pass

    def _finish(self, answer: tuple[int, str | bytes], keep: bool) -> None:
        code, out = answer
        if code != 200:
            self._respond(code, out, keep)
        else:
            view = self.srv.core.view
            view.serve_begin()   # the bulk refresh waits for the answer to leave, as for a Place call (fleet.py)
            try:
                self._respond(code, out, keep)
            finally:
                view.serve_end()
        if keep:
            self._arm()   # the wait for the next request

    def _refuse_oversized(self) -> None:
        length, limit = self.need, self.srv.section.max_request_bytes
        self._respond(413, f"body of {length} bytes is over {KEY}.max_request_bytes = {limit}\n", False)

    def _respond(self, code: int, body: str | bytes, keep: bool) -> None:
        """The status line, headers and body in one write; the connection closed after it unless `keep`."""
        if self.transport.is_closing():
            return
        self.transport.write(_response(code, body, keep))
        if not keep:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.transport.close()


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
