"""deploy/cluster/: NATS as a 3-server StatefulSet with volumes, gateways (3 replicas behind a
Service), workers and scheduler replicas; validated as deploy/ is (the Kubernetes schemas, strict;
the config through the collector's real loader; the NetworkPolicies against the pods), and the NATS
config by the real nats-server (-t)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from helpers import ROOT, validate_manifests
from manifest_checks import insecure_listens, policy_problems, selects

from xpusense.collector.certs import make_nats_certs
from xpusense.collector.cluster.localnats import nats_server_binary
from xpusense.collector.cluster.nats_auth import authorization_conf, route_tls_conf, tls_conf
from xpusense.collector.config import load_collector

DEPLOY = ROOT / "deploy" / "cluster"


def documents():
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def by_kind(kind: str) -> dict:
    return {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == kind}


def test_cluster_manifests_validate_against_the_kubernetes_schemas():
    kinds = validate_manifests(documents(), "deploy/cluster")
    assert sorted(kinds) == sorted(["ConfigMap", "Service", "Service", "StatefulSet", "PodDisruptionBudget",
                                    "ConfigMap", "Deployment", "Service", "Service", "PodDisruptionBudget",
                                    "Deployment", "Deployment", "Service", "NetworkPolicy", "NetworkPolicy",
                                    "NetworkPolicy", "NetworkPolicy"])


def test_network_policies_cover_every_pod_and_port_and_deny_the_rest():
    docs = [doc for _, doc in documents()]
    assert policy_problems(docs) == []
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
              for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    nats = by_kind("NetworkPolicy")["nats"]["spec"]["ingress"]
    by_port = {r["ports"][0]["port"]: r["from"] for r in nats}
    # NATS clients: xpusense's roles only, never another pod of the namespace or another namespace.
    client = by_port[4222][0]["podSelector"]
    assert {n for n, lab in labels.items() if selects(client, lab)} == {"xpusense-gateway", "xpusense-worker",
                                                                         "xpusense-scheduler"}
    assert selects(client, {"app.kubernetes.io/name": "xpusense-exporter"})
    assert {n for n, lab in labels.items() if selects(by_port[6222][0]["podSelector"], lab)} == {"nats"}
    assert by_port[8222] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    sched = {r["ports"][0]["port"]: r["from"] for r in by_kind("NetworkPolicy")["xpusense-scheduler"]["spec"]["ingress"]}
    assert sched[9470] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert sched[7470] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}]


def test_the_gateways_and_schedulers_listen_with_mtls_only():
    cfg = by_kind("ConfigMap")["xpusense-cluster"]["data"]["collector.toml"]
    assert insecure_listens(cfg) == []


def test_nats_is_a_3_replica_statefulset_with_volumes_and_routes_to_each():
    sts = by_kind("StatefulSet")["nats"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "nats-cluster"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = by_kind("ConfigMap")["nats"]["data"]["nats.conf"]
    routes = re.findall(r"nats-route://([\w.-]+):6222", conf)
    assert routes == [f"nats-{i}.nats-cluster.xpusense.svc.cluster.local" for i in range(3)]
    mounts = {m["name"]: m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert re.search(r"store_dir: (\S+)", conf).group(1).startswith(mounts["data"])
    assert by_kind("Service")["nats-cluster"]["spec"]["clusterIP"] == "None"


def _secret_files(tmp_path) -> str:
    """The Secret nats-tls as the pods see it: tls.crt, tls.key, ca.crt (made by `certs --nats`)."""
    made = make_nats_certs(str(tmp_path / "pki"), ["nats.xpusense.svc"])
    d = tmp_path / "tls"
    d.mkdir()
    for name, src in (("tls.crt", made["server"]["cert"]), ("tls.key", made["server"]["key"]), ("ca.crt", made["ca"])):
        shutil.copy(src, d / name)
    return str(d)


def test_nats_config_is_accepted_by_the_real_nats_server(tmp_path):
    conf = by_kind("ConfigMap")["nats"]["data"]["nats.conf"]
    conf = conf.replace("/data/jetstream", str(tmp_path / "js")).replace("/var/run/nats", str(tmp_path))
    conf = conf.replace("/etc/nats/tls", _secret_files(tmp_path))
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "POD_NAME": "nats-0"})
    assert r.returncode == 0, r.stdout + r.stderr
    path.write_text(conf.replace("cluster {", "cluster {{"))
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "POD_NAME": "nats-0"})
    assert r.returncode != 0                       # the check does catch a broken file


def test_roles_run_the_console_script_with_the_shared_config(tmp_path):
    cfg_text = by_kind("ConfigMap")["xpusense-cluster"]["data"]["collector.toml"]
    path = tmp_path / "collector.toml"
    path.write_text(cfg_text)
    cfg = load_collector(str(path), env={})
    assert cfg.nats.urls == ["tls://nats.xpusense.svc:4222"] and cfg.nats.replicas == 3
    deps = by_kind("Deployment")
    roles = {name: d["spec"]["template"]["spec"]["containers"][0]["command"] for name, d in deps.items()}
    assert roles["xpusense-gateway"][1] == "serve" and roles["xpusense-worker"][1] == "worker"
    assert roles["xpusense-scheduler"][1] == "scheduler"
    for command in roles.values():
        assert command[0].endswith("/xpusense-collector") and command[2:4] == ["--config", "/etc/xpusense/collector.toml"]
    # Only the scheduler replicas serve kube-scheduler's extender, on their Service's extender port.
    assert [c[4:] for c in roles.values() if c[4:]] == [["--extender-listen", "0.0.0.0:9471"]]
    ext = {p["name"]: p["port"] for p in by_kind("Service")["xpusense-scheduler"]["spec"]["ports"]}["extender"]
    assert roles["xpusense-scheduler"][5] == f"0.0.0.0:{ext}"
    assert deps["xpusense-gateway"]["spec"]["replicas"] == 3
    port = int(cfg.listen.rsplit(":", 1)[1])
    for svc in ("xpusense-gateway", "xpusense-gateway-pods", "xpusense-scheduler"):
        assert by_kind("Service")[svc]["spec"]["ports"][0]["port"] == port
    assert by_kind("Service")["xpusense-gateway-pods"]["spec"]["clusterIP"] == "None"
    # The scheduler replicas serve the fleet's Prometheus endpoint on the Service's metrics port.
    assert cfg.export.prometheus.enabled
    metrics = {p["name"]: p["port"] for p in by_kind("Service")["xpusense-scheduler"]["spec"]["ports"]}
    assert metrics["metrics"] == int(cfg.export.prometheus.listen.rsplit(":", 1)[1])


def _volume(deployment: dict, mount_dir: str) -> dict:
    spec = deployment["spec"]["template"]["spec"]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == mount_dir)
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])


def test_nats_requires_tls_and_carries_the_rendered_role_permissions(tmp_path):
    """The servers' authorization is nats_auth.py's, rendered for the [nats] table the roles run
    with (a drift either way fails here); TLS with verify_and_map on clients and routes, the
    certificates from the Secret nats-tls; each role's pods get its own NATS client certificate."""
    conf = by_kind("ConfigMap")["nats"]["data"]["nats.conf"]
    path = tmp_path / "collector.toml"
    path.write_text(by_kind("ConfigMap")["xpusense-cluster"]["data"]["collector.toml"])
    cfg = load_collector(str(path), env={})
    pem = ("/etc/nats/tls/tls.crt", "/etc/nats/tls/tls.key", "/etc/nats/tls/ca.crt")
    rendered = authorization_conf(cfg.nats)
    assert "\n" + rendered in conf, "deploy/cluster/nats.yaml's authorization differs from nats_auth.py's for " \
        "xpusense.yaml's [nats]: paste `python -m xpusense.collector.cluster.nats_auth --config collector.toml`"
    assert conf.count("authorization {") == 2 and "no_auth_user" not in conf
    assert "\n" + tls_conf(*pem) in conf and "\n" + route_tls_conf(*pem, indent="  ") in conf
    sts = by_kind("StatefulSet")["nats"]
    assert _volume(sts, "/etc/nats/tls")["secret"]["secretName"] == "nats-tls"
    n = cfg.nats
    assert all(u.startswith("tls://") for u in n.urls)
    directory = str(Path(n.tls_cert).parent)
    assert {n.tls_ca, n.tls_cert, n.tls_key} == {f"{directory}/ca.crt", f"{directory}/tls.crt", f"{directory}/tls.key"}
    for role in ("gateway", "worker", "scheduler"):
        assert _volume(by_kind("Deployment")[f"xpusense-{role}"], directory)["secret"]["secretName"] == \
            f"xpusense-nats-{role}"
