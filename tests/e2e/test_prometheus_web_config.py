"""/metrics behind a Prometheus web-config file (`--web-config-file`): Debian's real `prometheus`
scrapes the collector over TLS with basic auth and its target is up, while its jobs with a wrong
password or over plain HTTP are down; a scrape without credentials gets 401 with a Basic challenge,
one over plain HTTP gets no answer, and a cluster scheduler replica serves its /metrics the same way."""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.parse
import urllib.request

import bcrypt
import pytest
import real_prometheus
from cluster_support import cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, free_port, nodes_json, wait_until
from real_prometheus import query

from xpusense.collector.certs import make_certs

PASSWORD = "scrape-s3cret"


@pytest.fixture
def web_config(tmp_path):
    """A web-config file (TLS with the test CA's server certificate, one bcrypt user, a header) and the CA."""
    certs = make_certs(str(tmp_path / "certs"), ["prometheus"])
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {certs['collector']['cert']}\n"
                    f"  key_file: {certs['collector']['key']}\n"
                    f"http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
                    f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return path, certs["ca"]


def get(url: str, ca: str, user: str | None = None, password: str = PASSWORD):
    """(status, headers, body) of a GET; HTTP errors are answers too."""
    req = urllib.request.Request(url)
    if user is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    ctx = ssl.create_default_context(cafile=ca) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def assert_protected(metrics: str, ca: str) -> str:
    """The endpoint answers only over TLS and only to the user; returns the authorised scrape's text."""
    status, headers, body = get(f"https://{metrics}/metrics", ca, "prometheus")
    assert status == 200 and headers["X-Content-Type-Options"] == "nosniff", (status, body[:300])
    status, headers, _ = get(f"https://{metrics}/metrics", ca)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic "), status
    assert get(f"https://{metrics}/metrics", ca, "prometheus", "wrong")[0] == 401
    assert get(f"https://{metrics}/metrics", ca, "nobody")[0] == 401
    with pytest.raises((urllib.error.URLError, ConnectionError)):   # plain HTTP to a TLS port: no answer
        get(f"http://{metrics}/metrics", ca, "prometheus")
    return body


def test_prometheus_scrapes_over_tls_with_basic_auth_and_is_refused_without(procs, tmp_path, web_config):
    real_prometheus.binary()
    web, ca = web_config
    addr, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ccfg = tmp_path / "collector.toml"
    ccfg.write_text(f'[export.prometheus]\nenabled = true\nlisten = "{metrics}"\n')
    procs([str(BIN / "xpusense-collector"), "serve", "--config", str(ccfg), "--listen", addr,
           "--web-config-file", str(web)], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
    assert_protected(metrics, ca)

    def job(name: str, scheme: str, password: str) -> str:
        return (f"  - job_name: {name}\n    scheme: {scheme}\n    tls_config:\n      ca_file: {ca}\n"
                f"    basic_auth:\n      username: prometheus\n      password: {password}\n"
                f"    static_configs:\n      - targets: ['{metrics}']\n")
    prom = real_prometheus.start(procs, tmp_path, real_prometheus.SCRAPE_1S + "scrape_configs:\n" + job("good", "https", PASSWORD)
                                 + job("wrong", "https", "not-it") + job("plain", "http", PASSWORD))

    def up() -> dict[str, str]:
        return {r["metric"]["job"]: r["value"][1] for r in query(prom, "up")}
    wait_until(lambda: up() == {"good": "1", "wrong": "0", "plain": "0"}, timeout_s=120,
               what=lambda: f"the TLS + basic auth job up, the others down (up: {up()})")
    # What Prometheus scraped is the collector's own count of the refusals: the wrong job's 401s
    # and the plain job's failed TLS handshakes.
    refused = {r["metric"]["reason"]: float(r["value"][1])
               for r in query(prom, 'xpusense_collector_prometheus_refused_total{job="good"}')}
    assert refused["unauthorized"] >= 1 and refused["tls"] >= 1, refused


def test_scheduler_replica_serves_metrics_behind_the_web_config(nats_cluster, procs, tmp_path,  # noqa: F811
                                                                 web_config):
    web, ca = web_config
    metrics = f"127.0.0.1:{free_port()}"
    cfg = cluster_config(tmp_path, nats_cluster)
    start_gateway(procs, cfg)   # the gateway makes the buckets a replica reads
    scfg = cluster_config(tmp_path, nats_cluster, name="scheduler.toml",
                          extra=f'[export.prometheus]\nenabled = true\nlisten = "{metrics}"\n')
    s = procs(module_cmd("scheduler", "--config", str(scfg), "--listen", f"127.0.0.1:{free_port()}",
                         "--web-config-file", str(web)), "scheduler")
    wait_until(lambda: "scheduler listening" in s.output() or s.p.poll() is not None, 60, what="the replica")
    assert s.p.poll() is None, s.output()
    assert "xpusense_node_connected" in assert_protected(metrics, ca)
