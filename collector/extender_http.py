"""The HTTP endpoint of kube-scheduler's extender (`[kubernetes.extender]`, `--extender-listen`): POST
/filter and /prioritize, served from a thread (bodies read and JSON parsed off the event loop); the
decision itself runs on the loop that owns the fleet state, in one go, as Place does. TLS and the
fleet's tokens as on the gRPC port; bounded bodies and connections, each bound counted."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from xpusense.common.config import ConfigError, split_host_port
from xpusense.common.tls import is_loopback_host

from .grpc_server import BindError
from .scheduler.core import Scheduler
from .scheduler.extender import filter_result, priorities

log = logging.getLogger("xpusense.collector.extender")

VERBS = {"/filter": filter_result, "/prioritize": priorities}
KEY = "kubernetes.extender"


def check_section(cfg: Any, where: str) -> None:
    """Plaintext on a non-loopback extender address needs TLS or allow_insecure, as `listen` does."""
    ext = cfg.kubernetes.extender
    host, _ = split_host_port(ext.listen)
    if ext.enabled and not is_loopback_host(host) and not cfg.tls.cert and not cfg.allow_insecure:
        raise ConfigError(f"{where}: '{KEY}.listen' = {ext.listen!r} is not a loopback address and no TLS is "
                          f"configured: set [tls] cert and key (and ca for client certificates), or "
                          f"allow_insecure = true")


class ExtenderServer:
    """The endpoint over a scheduler core. `cfg`: the collector's loaded config; `security`: its
    collector.auth.Security (tokens) or None; `counters`: where the bounds' hits are counted."""

    def __init__(self, core: Scheduler, cfg: Any, security: Any = None, counters: Counter | None = None):
        self.core, self.section, self.security = core, cfg.kubernetes.extender, security
        self.tls = cfg.tls
        self.counters: Counter = counters if counters is not None else Counter()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slots = threading.BoundedSemaphore(int(self.section.max_connections))
        self.httpd: ThreadingHTTPServer | None = None
        self.address = ""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind and serve from a thread; decisions run on `loop`. OSError when the address is unusable."""
        self.loop = loop
        host, port = split_host_port(self.section.listen)
        server = self
        timeout = float(self.section.timeout_s)

        class Handler(_Handler):
            ext = server

        Handler.timeout = timeout   # a connection silent this long is closed (socket timeout)
        httpd = ThreadingHTTPServer((host, port), Handler)
        httpd.daemon_threads = True
        if self.tls.cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.tls.cert, self.tls.key)
            if self.tls.ca:
                ctx.load_verify_locations(self.tls.ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
            httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.httpd = httpd
        self.address = f"{host}:{httpd.server_address[1]}"
        threading.Thread(target=httpd.serve_forever, name="extender-http", daemon=True).start()
        log.info("kube-scheduler extender on %s://%s/ (filter, prioritize)", "https" if self.tls.cert else "http",
                 self.address)

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    async def _decide(self, verb, doc: Any) -> Any:
        view = self.core.view
        view.serve_begin()   # the bulk refresh waits for it, as for a Place call (scheduler/fleet.py)
        try:
            return verb(self.core, doc)
        finally:
            view.serve_end()

    def decide(self, verb, doc: Any) -> Any:
        """Run on the loop thread; TimeoutError past timeout_s."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._decide(verb, doc), self.loop)
        try:
            return fut.result(float(self.section.timeout_s))
        except TimeoutError:
            fut.cancel()
            raise


class _Handler(BaseHTTPRequestHandler):
    ext: ExtenderServer
    protocol_version = "HTTP/1.1"
    server_version = "xpusense-extender"

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 (the base class's name)
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, body: Any, text: bool = False) -> None:
        data = (body if text else json.dumps(body, separators=(",", ":"))).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, code: int, counter: str, why: str) -> None:
        self.ext.counters[counter] += 1
        self.close_connection = True
        self._send(code, why + "\n", text=True)

    def do_GET(self) -> None:
        self._refuse(405, "kubernetes.extender.refused", "POST /filter or /prioritize (kube-scheduler's extender)")

    def do_POST(self) -> None:
        ext = self.ext
        if not ext.slots.acquire(blocking=False):
            self._refuse(503, f"{KEY}.max_connections", f"{KEY}.max_connections requests in progress; retry")
            return
        try:
            self._post()
        finally:
            ext.slots.release()

    def _post(self) -> None:
        ext, section = self.ext, self.ext.section
        ext.counters[f"{KEY}.requests"] += 1
        verb = VERBS.get(self.path.split("?", 1)[0].rstrip("/") or "/")
        if verb is None:
            self._refuse(404, f"{KEY}.refused", f"no verb {self.path[:100]!r}: POST /filter or /prioritize")
            return
        sec = ext.security
        if sec is not None and sec.tokens is not None and not sec.mtls:
            if not sec.token_valid([("authorization", self.headers.get("Authorization", ""))]):
                sec.refusals += 1
                self._refuse(401, f"{KEY}.refused", "a valid bearer token of the fleet is needed (Authorization)")
                return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._refuse(411, f"{KEY}.refused", "Content-Length is needed")
            return
        if int(length) > section.max_request_bytes:
            self._refuse(413, f"{KEY}.max_request_bytes",
                         f"body of {length} bytes is over {KEY}.max_request_bytes = {section.max_request_bytes}")
            return
        body = self.rfile.read(int(length))
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as e:
            ext.counters[f"{KEY}.errors"] += 1
            self._send(400, f"the body is not JSON ({e})\n", text=True)
            return
        try:
            out = ext.decide(verb, doc)
        except TimeoutError:
            self._refuse(503, f"{KEY}.timeout_s", f"no decision within {KEY}.timeout_s = {section.timeout_s:g} s")
            return
        except ValueError as e:   # prioritize's unreadable request, ExtenderError or the core's PlaceError
            ext.counters[f"{KEY}.errors"] += 1
            self._send(400, f"{e}\n", text=True)
            return
        if isinstance(out, dict) and out.get("Error"):
            ext.counters[f"{KEY}.errors"] += 1
        self._send(200, out)


def start_extender(cfg: Any, core: Scheduler, security: Any = None, counters: Counter | None = None,
                   ) -> ExtenderServer | None:
    """The extender over `core` when `[kubernetes.extender] enabled` (on the running loop); None
    when off. BindError (collector/grpc_server.py) when its address cannot be bound."""
    if cfg is None or not cfg.kubernetes.extender.enabled:
        return None
    ext = ExtenderServer(core, cfg, security, counters)
    try:
        ext.start(asyncio.get_running_loop())
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
