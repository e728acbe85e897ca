"""deploy/scheduler.yaml (a second kube-scheduler whose profile's extender is the collector) and the
agent's node labels in the DaemonSet: the KubeSchedulerConfiguration inside the ConfigMap checked
against kube-scheduler's config v1 types (it is no API object, so the Kubernetes schemas do not
cover it), and each of its references against the manifests it points at."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import ssl
import threading
import tomllib
import urllib.error
import urllib.request
from argparse import Namespace

import pytest
import yaml
from helpers import ROOT, free_port
from manifest_checks import selects

from xpusense.agent.config import load_agent
from xpusense.collector.auth import Security
from xpusense.collector.certs import make_certs
from xpusense.collector.config import load_collector
from xpusense.collector.extender_http import VERBS, ExtenderServer, check_section, extender_flags
from xpusense.collector.scheduler.core import Scheduler
from xpusense.collector.scheduler.extender import GPU_RESOURCES, NPU_PREFIX
from xpusense.collector.state import FleetState

DEPLOY = ROOT / "deploy"
DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")
QUALIFIED = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

# k8s.io/kube-scheduler/config/v1 (types.go): field -> type; a dict is a nested struct.
TLS = {"insecure": bool, "serverName": str, "certFile": str, "keyFile": str, "caFile": str,
       "certData": str, "keyData": str, "caData": str}
EXTENDER = {"urlPrefix": str, "filterVerb": str, "preemptVerb": str, "prioritizeVerb": str, "weight": int,
            "bindVerb": str, "enableHTTPS": bool, "tlsConfig": TLS, "httpTimeout": "duration",
            "nodeCacheCapable": bool, "managedResources": [{"name": str, "ignoredByScheduler": bool}],
            "ignorable": bool}
LEADER_ELECTION = {"leaderElect": bool, "leaseDuration": "duration", "renewDeadline": "duration",
                   "retryPeriod": "duration", "resourceLock": str, "resourceName": str, "resourceNamespace": str}
CONFIG = {"apiVersion": str, "kind": str, "parallelism": int, "leaderElection": LEADER_ELECTION,
          "clientConnection": {"kubeconfig": str, "acceptContentTypes": str, "contentType": str, "qps": float,
                               "burst": int},
          "enableProfiling": bool, "enableContentionProfiling": bool, "percentageOfNodesToScore": int,
          "podInitialBackoffSeconds": int, "podMaxBackoffSeconds": int, "delayCacheUntilActive": bool,
          "profiles": [{"schedulerName": str, "percentageOfNodesToScore": int, "plugins": dict,
                        "pluginConfig": list}],
          "extenders": [EXTENDER]}


def shape_problems(value, spec, path: str) -> list[str]:
    """Unknown fields and wrong types (kube-scheduler's strict decoding refuses both)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{path}: an object expected"]
        out = [f"{path}.{k}: unknown field" for k in value if k not in spec]
        for k, v in value.items():
            if k in spec:
                out += shape_problems(v, spec[k], f"{path}.{k}")
        return out
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{path}: a list expected"]
        return [p for i, v in enumerate(value) for p in shape_problems(v, spec[0], f"{path}[{i}]")]
    if spec == "duration":
        return [] if isinstance(value, str) and DURATION.fullmatch(value) else [f"{path}: {value!r} is not a duration"]
    ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
    if spec is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return [] if ok else [f"{path}: {value!r} is not a {spec.__name__}"]


def kube_scheduler_config_problems(cfg: dict) -> list[str]:
    """The shape, then what kube-scheduler's validation (pkg/scheduler/apis/config/validation) refuses."""
    out = shape_problems(cfg, CONFIG, "config")
    if cfg.get("apiVersion") != "kubescheduler.config.k8s.io/v1" or cfg.get("kind") != "KubeSchedulerConfiguration":
        out.append("config: not a kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration")
    names = [p.get("schedulerName", "default-scheduler") for p in cfg.get("profiles", [])]
    if len(set(names)) != len(names) or "" in names:
        out.append(f"profiles: scheduler names must be set and unique: {names}")
    for i, e in enumerate(cfg.get("extenders", [])):
        if e.get("prioritizeVerb") and not (isinstance(e.get("weight"), int) and e["weight"] > 0):
            out.append(f"extenders[{i}]: a prioritizeVerb needs a positive weight")
        for r in e.get("managedResources", []):
            if not QUALIFIED.fullmatch(r.get("name", "")) or r["name"].split("/")[0].endswith("kubernetes.io"):
                out.append(f"extenders[{i}]: {r.get('name')!r} is not an extended resource name")
    if sum(bool(e.get("bindVerb")) for e in cfg.get("extenders", [])) > 1:
        out.append("extenders: only one may bind")
    return out


def documents() -> list[dict]:
    return [d for path in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str) -> dict:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def scheduler_config() -> dict:
    return yaml.safe_load(find("ConfigMap", "xpusense-kube-scheduler")["data"]["config.yaml"])


def test_the_scheduler_profile_is_a_valid_kube_scheduler_configuration_with_the_extender():
    cfg = scheduler_config()
    assert kube_scheduler_config_problems(cfg) == []
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["xpusense-scheduler"]   # pods: spec.schedulerName
    [ext] = cfg["extenders"]
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["nodeCacheCapable"], ext["ignorable"]) == \
        ("filter", "prioritize", True, False)
    assert {"/" + ext["filterVerb"], "/" + ext["prioritizeVerb"]} == set(VERBS)   # what the collector serves
    managed = [r["name"] for r in ext["managedResources"]]
    assert set(GPU_RESOURCES) <= set(managed) and all(r in GPU_RESOURCES or r.lower().startswith(NPU_PREFIX)
                                                      for r in managed)
    assert {"huawei.com/Ascend910", "huawei.com/Ascend310P"} <= set(managed)


def test_the_check_catches_what_kube_scheduler_refuses():
    cfg = scheduler_config()
    cfg["extenders"][0]["nodeCacheCapabel"] = True
    cfg["extenders"][0]["weight"] = 0
    cfg["extenders"][0]["httpTimeout"] = "5 seconds"
    cfg["extenders"][0]["managedResources"].append({"name": "gpu"})
    cfg["profiles"].append({"schedulerName": "xpusense-scheduler"})
    cfg["leaderElection"]["leaderElect"] = "yes"
    assert kube_scheduler_config_problems(cfg) == [
        "config.leaderElection.leaderElect: 'yes' is not a bool",
        "config.extenders[0].nodeCacheCapabel: unknown field",
        "config.extenders[0].httpTimeout: '5 seconds' is not a duration",
        "profiles: scheduler names must be set and unique: ['xpusense-scheduler', 'xpusense-scheduler']",
        "extenders[0]: a prioritizeVerb needs a positive weight",
        "extenders[0]: 'gpu' is not an extended resource name"]


def test_the_extender_url_reaches_the_collectors_extender_through_its_service(tmp_path):
    ext = scheduler_config()["extenders"][0]
    m = re.fullmatch(r"(https?)://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)/", ext["urlPrefix"])
    assert m, ext["urlPrefix"]
    scheme, service, namespace, port = m[1], m[2], m[3], int(m[4])
    svc = find("Service", service)
    assert svc["metadata"]["namespace"] == namespace
    sport = next(p for p in svc["spec"]["ports"] if p["port"] == port)
    collector = find("Deployment", "xpusense-collector")["spec"]["template"]
    assert all(collector["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
    cport = next(p for c in collector["spec"]["containers"] for p in c["ports"] if p["name"] == sport["targetPort"])
    toml = tmp_path / "collector.toml"
    toml.write_text(find("ConfigMap", "xpusense-collector")["data"]["collector.toml"])
    ccfg = load_collector(str(toml), env={})
    assert ccfg.kubernetes.extender.enabled and int(ccfg.kubernetes.extender.listen.rsplit(":", 1)[1]) == \
        cport["containerPort"]
    # HTTPS as the collector serves it (its certificate), with the name the collector's probe checks too.
    assert scheme == "https" and ext["enableHTTPS"] and ccfg.tls.cert and ccfg.tls.ca
    assert ext["tlsConfig"]["serverName"] == f"{service}.{namespace}.svc"
    # Only the scheduler's pods may reach that port.
    policy = find("NetworkPolicy", "xpusense-collector-extender")
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "xpusense-kube-scheduler"}}}], "ports": [{"port": port, "protocol": "TCP"}]}]


def test_the_scheduler_deployment_mounts_its_config_and_client_certificate_and_has_its_rbac():
    dep = find("Deployment", "xpusense-kube-scheduler")
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    config_arg = next(a.split("=", 1)[1] for a in c["command"] if a.startswith("--config="))
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    assert config_arg.rsplit("/", 1) == ["/etc/xpusense-kube-scheduler", "config.yaml"]
    assert vols[mounts["/etc/xpusense-kube-scheduler"]]["configMap"]["name"] == "xpusense-kube-scheduler"
    tls = scheduler_config()["extenders"][0]["tlsConfig"]
    for f in (tls["caFile"], tls["certFile"], tls["keyFile"]):
        directory = f.rsplit("/", 1)[0]
        assert "secret" in vols[mounts[directory]], f
    assert c["securityContext"]["readOnlyRootFilesystem"] and spec["securityContext"]["runAsNonRoot"]
    sa = spec["serviceAccountName"]
    bound = {(b["kind"], b["roleRef"]["name"]) for b in documents() if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
             and {"kind": "ServiceAccount", "name": sa, "namespace": "xpusense"} in b["subjects"]}
    assert {("ClusterRoleBinding", "system:kube-scheduler"), ("ClusterRoleBinding", "system:volume-scheduler"),
            ("RoleBinding", "extension-apiserver-authentication-reader"),
            ("RoleBinding", "xpusense-kube-scheduler-leader-election")} <= bound
    lease = scheduler_config()["leaderElection"]
    role = find("Role", "xpusense-kube-scheduler-leader-election")
    assert role["metadata"]["namespace"] == lease["resourceNamespace"]
    assert any(lease["resourceName"] in r.get("resourceNames", []) and "update" in r["verbs"] for r in role["rules"])


def test_the_daemonset_gives_the_agent_nfds_features_folder_and_the_node_name(tmp_path):
    toml = find("ConfigMap", "xpusense-agent")["data"]["agent.toml"]
    path = tomllib.loads(toml)["k8s"]["nfd_feature_file"]
    (tmp_path / "agent.toml").write_text(toml)
    cfg = load_agent(str(tmp_path / "agent.toml"), env={"XPUSENSE_K8S_NODE_NAME": "n1"})
    assert cfg.k8s.nfd_feature_file == path == "/etc/kubernetes/node-feature-discovery/features.d/xpusense"
    assert cfg.k8s.node_name == "n1"
    spec = find("DaemonSet", "xpusense-agent")["spec"]["template"]["spec"]
    agent = spec["containers"][0]
    folder = path.rsplit("/", 1)[0]
    mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == folder)
    assert not mount.get("readOnly")
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert vol["hostPath"] == {"path": folder, "type": "DirectoryOrCreate"}   # where nfd-worker reads
    env = {e["name"]: e for e in agent["env"]}
    assert env["XPUSENSE_K8S_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_in_cluster_mode_the_scheduler_replicas_serve_the_extender_to_the_kube_scheduler_pods(tmp_path):
    cluster = [d for path in sorted((DEPLOY / "cluster").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
               if d]
    dep = next(d for d in cluster if d["kind"] == "Deployment" and d["metadata"]["name"] == "xpusense-scheduler")
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    listen = command[command.index("--extender-listen") + 1]
    toml = tmp_path / "collector.toml"
    toml.write_text(next(d for d in cluster if d["kind"] == "ConfigMap"
                         and d["metadata"]["name"] == "xpusense-cluster")["data"]["collector.toml"])
    cfg = load_collector(str(toml), env={}, flags=extender_flags(Namespace(extender_listen=listen)))
    check_section(cfg, "deploy/cluster")   # HTTPS: the replicas' certificate, not plaintext
    assert cfg.kubernetes.extender.enabled and cfg.tls.cert and cfg.tls.ca
    port = int(listen.rsplit(":", 1)[1])
    rules = next(d for d in cluster if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "xpusense-scheduler")
    [rule] = [r for r in rules["spec"]["ingress"] if r["ports"] == [{"port": port, "protocol": "TCP"}]]
    kube_scheduler = find("Deployment", "xpusense-kube-scheduler")
    [peer] = rule["from"]
    assert selects(peer["podSelector"], kube_scheduler["spec"]["template"]["metadata"]["labels"])
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name":
                                                        kube_scheduler["metadata"]["namespace"]}


def test_the_kube_scheduler_reaches_the_collectors_extender_over_https_with_the_documented_pair(tmp_path):
    """The pair made and put in its Secret as docs/kubernetes.md says, the tlsConfig of the profile,
    and the collector's ConfigMap with the collector's Secret: a real HTTPS POST /filter on loopback."""
    doc = (ROOT / "docs/kubernetes.md").read_text().split("## Deploying the extender", 1)[1]
    security = (ROOT / "docs/security.md").read_text().split("### Kubernetes", 1)[1]
    hosts = re.findall(r"--collector-host (\S+)", security)
    pki = tmp_path / "pki"
    make_certs(str(pki), ["xpusense-probe", "kube-scheduler"], hosts, days=2)
    secret = tmp_path / "xpusense-kube-scheduler-tls"    # kubectl create secret ... --from-file=pki/F
    secret.mkdir()
    line = next(ln for ln in doc.split("```sh", 1)[1].split("```")[0].split("kubectl") if "xpusense-kube-scheduler-tls" in ln)
    for f in re.findall(r"--from-file=pki/(\S+)", line):
        shutil.copy(pki / f, secret / f)
    tls = scheduler_config()["extenders"][0]["tlsConfig"]
    mount = "/etc/xpusense-tls"
    ctx = ssl.create_default_context(cafile=tls["caFile"].replace(mount, str(secret)))
    port = free_port()
    text = find("ConfigMap", "xpusense-collector")["data"]["collector.toml"]
    for key, src in {"ca.pem": "ca.pem", "collector.pem": "collector.pem", "collector.key": "collector.key"}.items():
        text = text.replace(f"{mount}/{key}", str(pki / src))
    (tmp_path / "collector.toml").write_text(text.replace('listen = "0.0.0.0:9471"', f'listen = "127.0.0.1:{port}"'))
    cfg = load_collector(str(tmp_path / "collector.toml"), env={})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ext = ExtenderServer(Scheduler(FleetState(), cfg.scheduler, cfg.stale_s), cfg, Security.from_config(cfg))
    asyncio.run_coroutine_threadsafe(ext.start(), loop).result(10)
    body = json.dumps({"Pod": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
                               "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
                       "NodeNames": ["n1"]}).encode()

    def post(context):
        req = urllib.request.Request(f"https://127.0.0.1:{port}/{scheduler_config()['extenders'][0]['filterVerb']}",
                                     data=body)
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return json.loads(r.read())
    try:
        ctx.check_hostname = False    # the name is checked below, as kube-scheduler's serverName does
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            post(ctx)                 # no client certificate
        ctx.load_cert_chain(tls["certFile"].replace(mount, str(secret)), tls["keyFile"].replace(mount, str(secret)))
        reply = post(ctx)
        assert reply["NodeNames"] == [] and "unknown" in reply["FailedAndUnresolvableNodes"]["n1"]
        # The collector's certificate carries the serverName the profile checks.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            strict = ssl.create_default_context(cafile=str(secret / "ca.pem"))
            strict.load_cert_chain(str(secret / "kube-scheduler.pem"), str(secret / "kube-scheduler.key"))
            with strict.wrap_socket(raw, server_hostname=tls["serverName"]) as s:
                assert s.version()
    finally:
        asyncio.run_coroutine_threadsafe(ext.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
