"""A real Prometheus for the tests: the binaries (the test is skipped where Debian's prometheus is
not installed), one started on a config the test writes (checked by promtool first), and its HTTP
API's answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers import BIN, free_port, nodes_json, wait_until

SCRAPE_1S = "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"


def binary(name: str = "prometheus") -> str:
    """`prometheus` or `promtool`; the test is skipped without them."""
    exe = shutil.which(name)
    if not exe:
        pytest.skip("Debian's prometheus is not installed (scripts/setup.sh installs it)")
    return exe


def scrape_job(target: str, name: str = "xpusense") -> str:
    """The `scrape_configs` entry of one plain HTTP job."""
    return f"  - job_name: {name}\n    static_configs:\n      - targets: ['{target}']\n"


def start(procs, tmp_path: Path, config: str) -> str:
    """Prometheus on `config` (YAML, checked by `promtool check config`), its data under tmp_path;
    returns its address."""
    pcfg = tmp_path / "prometheus.yml"
    pcfg.write_text(config)
    check = subprocess.run([binary("promtool"), "check", "config", str(pcfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    prom = f"127.0.0.1:{free_port()}"
    procs([binary(), f"--config.file={pcfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
           f"--web.listen-address={prom}", "--log.level=warn"], "prometheus")
    return prom


def api(prom: str, path: str, **params: str):
    """The `data` of a successful answer from Prometheus' HTTP API at `path`."""
    url = f"http://{prom}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def query(prom: str, q: str) -> list[dict]:
    """An instant query's result vector."""
    return api(prom, "/api/v1/query", query=q)["result"]


def label_values(prom: str, label: str, selector: str) -> list[str]:
    """Grafana's label_values(SELECTOR, LABEL) variable query."""
    return sorted(api(prom, f"/api/v1/label/{label}/values", **{"match[]": selector}))


def collector_with_metrics(procs, tmp_path: Path) -> tuple[str, str]:
    """A collector serving /metrics with the dashboards' names too (compat_names); its gRPC and
    /metrics addresses, once it answers."""
    addr, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ccfg = tmp_path / "collector.toml"
    ccfg.write_text(f'[export.prometheus]\nenabled = true\nlisten = "{metrics}"\ncompat_names = true\n')
    procs([str(BIN / "xpusense-collector"), "serve", "--config", str(ccfg), "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
    return addr, metrics
