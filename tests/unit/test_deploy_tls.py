"""The shipped manifests' mTLS, for real: credentials made as docs/security.md says (`certs`, the
Secrets' keys), laid out as the pods mount them, the collector's config from deploy/ through the
collector's own start checks, a real server on loopback, the agent's channel from agent-config.yaml
with its node's files, and each Deployment's readiness probe command (collector/probe.py) run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, InProcessCollector, free_port

from xpusense.agent.config import load_agent
from xpusense.collector.auth import Security
from xpusense.collector.certs import make_certs
from xpusense.collector.config import load_collector
from xpusense.collector.probe import check
from xpusense.common.tls import make_channel

MOUNT = "/etc/xpusense-tls"
NODE = "gpu-001"


def docs(*files: str) -> list[dict]:
    return [d for f in files for d in yaml.safe_load_all((ROOT / "deploy" / f).read_text()) if d]


def find(all_docs, kind, name):
    return next(d for d in all_docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    """The two Secrets' files as docs/security.md's commands make them: xpusense-collector-tls and
    xpusense-agent-tls (here for one node)."""
    text = (ROOT / "docs/security.md").read_text()
    hosts = re.findall(r"--collector-host (\S+)", text.split("### Kubernetes", 1)[1])
    services = {d["metadata"]["name"] for d in docs("collector.yaml", "cluster/xpusense.yaml") if d["kind"] == "Service"}
    assert {f"{s}.xpusense.svc" for s in services} <= set(hosts), "a Service name missing from the certs command"
    root = tmp_path_factory.mktemp("pki")
    make_certs(str(root / "pki"), [NODE, "xpusense-probe"], hosts, days=2)
    server, agent = root / "xpusense-collector-tls", root / "xpusense-agent-tls"
    server.mkdir()
    agent.mkdir()
    for key, src in {"ca.pem": "ca.pem", "collector.pem": "collector.pem", "collector.key": "collector.key",
                     "probe.pem": "xpusense-probe.pem", "probe.key": "xpusense-probe.key"}.items():
        shutil.copy(root / "pki" / src, server / key)
    for key in ("ca.pem", f"{NODE}.pem", f"{NODE}.key"):
        shutil.copy(root / "pki" / key, agent / key)
    other = root / "other"   # a CA of someone else's
    make_certs(str(other), ["intruder"], ["localhost"], days=2)
    return {"xpusense-collector-tls": server, "xpusense-agent-tls": agent, "other": other, "root": root}


def tls_volume(spec) -> str:
    vol = next(v for v in spec["volumes"] if v["name"] == "tls")
    return vol["secret"]["secretName"]


CASES = [("collector.yaml", "xpusense-collector", "xpusense-collector"),
         ("cluster/xpusense.yaml", "xpusense-cluster", "xpusense-gateway"),
         ("cluster/xpusense.yaml", "xpusense-cluster", "xpusense-scheduler")]


@pytest.mark.parametrize("file,configmap,deployment", CASES)
def test_the_server_side_starts_with_mtls_and_its_readiness_probe_gets_through(secrets, tmp_path, file, configmap,
                                                                              deployment):
    all_docs = docs(file)
    spec = find(all_docs, "Deployment", deployment)["spec"]["template"]["spec"]
    secret_dir = secrets[tls_volume(spec)]
    container = spec["containers"][0]
    assert {"name": "tls", "mountPath": MOUNT, "readOnly": True} in container["volumeMounts"]
    cfg_path = tmp_path / "collector.toml"
    cfg_path.write_text(find(all_docs, "ConfigMap", configmap)["data"]["collector.toml"].replace(MOUNT, str(secret_dir)))
    cfg = load_collector(str(cfg_path), env={})
    sec = Security.from_config(cfg)   # the collector's start checks, on the shipped 0.0.0.0 listen
    assert sec.mtls and not sec.loopback and not cfg.allow_insecure
    port = free_port()
    srv = InProcessCollector(port=port, security=sec, credentials=sec.server_credentials())
    try:
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe[:3] == ["/opt/xpusense/venv/bin/python", "-m", "xpusense.collector.probe"]
        argv = [sys.executable, *[a.replace(MOUNT, str(secret_dir)).replace("127.0.0.1:7470", f"127.0.0.1:{port}")
                                  for a in probe[1:]]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # What the kubelet's own gRPC probe would do: plaintext, no certificate. It cannot get in.
        assert "UNAVAILABLE" in check(f"127.0.0.1:{port}", timeout_s=5)
        # TLS without a client certificate, or with one of another CA, is refused at the handshake.
        name = argv[argv.index("--server-name") + 1]
        assert "UNAVAILABLE" in check(f"127.0.0.1:{port}", timeout_s=5, tls_ca=str(secret_dir / "ca.pem"),
                                      server_name=name)
        other = secrets["other"]
        why = check(f"127.0.0.1:{port}", timeout_s=5, tls_ca=str(secret_dir / "ca.pem"),
                    tls_cert=str(other / "intruder.pem"), tls_key=str(other / "intruder.key"), server_name=name)
        assert why is not None and "UNAVAILABLE" in why
        # A service the server does not have: the probe fails, naming it.
        bad = argv + ["--service", "xpusense.v1.Nope"]
        r = subprocess.run(bad, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    finally:
        srv.stop()


def test_the_agent_reaches_the_collector_with_its_node_pair_from_the_daemonset_mounts(secrets, tmp_path):
    all_docs = docs("agent-config.yaml", "agent-daemonset.yaml", "collector.yaml")
    spec = find(all_docs, "DaemonSet", "xpusense-agent")["spec"]["template"]["spec"]
    agent = spec["containers"][0]
    env = {e["name"]: e.get("value", NODE) for e in agent["env"]}   # spec.nodeName -> this node
    secret_dir = secrets[tls_volume(spec)]
    # The files the kubelet puts at each mount: the Secret key subPath / subPathExpr names.
    mounted = tmp_path / "etc-xpusense-tls"
    mounted.mkdir()
    for m in agent["volumeMounts"]:
        if m["name"] == "tls":
            key = m.get("subPath") or re.sub(r"\$\((\w+)\)", lambda g: env[g.group(1)], m["subPathExpr"])
            assert Path(m["mountPath"]).parent == Path(MOUNT) and m["readOnly"]
            shutil.copy(secret_dir / key, mounted / Path(m["mountPath"]).name)
    cfg_path = tmp_path / "agent.toml"
    cfg_path.write_text(find(all_docs, "ConfigMap", "xpusense-agent")["data"]["agent.toml"].replace(MOUNT, str(mounted)))
    cfg = load_agent(str(cfg_path), env=env)
    assert cfg.node_id == NODE and not cfg.collector.insecure
    server_cfg = tmp_path / "collector.toml"
    server_cfg.write_text(find(all_docs, "ConfigMap", "xpusense-collector")["data"]["collector.toml"].replace(
        MOUNT, str(secrets["xpusense-collector-tls"])))
    sec = Security.from_config(load_collector(str(server_cfg), env={}))
    port = free_port()
    srv = InProcessCollector(port=port, security=sec, credentials=sec.server_credentials())
    try:
        # The agent dials the Service name the DaemonSet gives it; here that name is the loopback port.
        service_host = cfg.collector.address.rsplit(":", 1)[0]
        assert service_host == "xpusense-collector.xpusense.svc"
        factory = make_channel(f"127.0.0.1:{port}", cfg.collector,
                               options=[("grpc.ssl_target_name_override", service_host)])
        assert factory.mode == "mTLS"
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with factory() as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="xpusense.v1.Ingest"),
                                                         timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop()


def test_the_probe_names_an_unusable_flag(capsys):
    from xpusense.collector.probe import main
    assert main(["--tls-cert", "/nonexistent/probe.pem"]) == 2
    assert "'--tls-key' must be set together with '--tls-cert'" in capsys.readouterr().err
    assert main(["--tls-ca", "/nonexistent/ca.pem"]) == 2
    assert "--tls-ca" in capsys.readouterr().err
