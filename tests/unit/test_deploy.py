"""Deployment artefacts: the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail), their NetworkPolicies against the pods they
are for, no plaintext on a routable address, the configs inside them through the real
config loaders, the Dockerfile parsed (dockerfile-parse; no container engine runs here, so the
image is not built), and the systemd units through `systemd-analyze verify`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, validate_manifests
from manifest_checks import insecure_listens, policy_problems

from xpusense.agent.config import load_agent
from xpusense.collector.config import load_collector

DEPLOY = ROOT / "deploy"
UNITS = ["xpusense-agent.service", "xpusense-collector.service"]


def documents():
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_manifests_validate_against_the_kubernetes_schemas():
    kinds = validate_manifests(documents(), "deploy")
    assert sorted(kinds) == sorted(["Namespace", "ConfigMap", "DaemonSet", "ConfigMap", "PersistentVolumeClaim",
                                    "Deployment", "Service", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy",
                                    "NetworkPolicy", "ServiceAccount", "ClusterRoleBinding", "ClusterRoleBinding",
                                    "RoleBinding", "Role", "RoleBinding", "ConfigMap", "Deployment"])


def test_a_broken_manifest_is_caught():
    kv = pytest.importorskip("kubernetes_validate")
    ds = next(doc for _, doc in documents() if doc["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["hostPid"] = True    # misspelt field
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)
    policy = next(doc for _, doc in documents() if doc["kind"] == "NetworkPolicy" and doc["spec"].get("ingress"))
    policy["spec"]["ingress"][0]["from"][0]["ipBlock"] = {"cidr": "10.0.0.0/8", "exept": ["10.1.0.0/16"]}
    with pytest.raises(kv.ValidationError):
        kv.validate(policy, kv.latest_version(), strict=True)


def test_network_policies_cover_every_pod_and_port_and_deny_the_rest():
    docs = [doc for _, doc in documents()]
    assert policy_problems(docs) == []
    # /metrics only from the monitoring namespace, by the label the API server sets on each namespace.
    metrics = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "xpusense-collector-metrics")
    assert metrics["spec"]["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": 9470, "protocol": "TCP"}]}]


def test_the_policy_checks_catch_what_they_are_for():
    docs = [doc for _, doc in documents()]
    ingest = next(d for d in docs if d["metadata"]["name"] == "xpusense-collector-ingest" and d["kind"] == "NetworkPolicy")
    ingest["spec"]["ingress"][0]["ports"][0]["port"] = 7471
    ingest["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] = "collector"
    problems = policy_problems(docs)
    assert "policy xpusense-collector-ingest: its podSelector selects no pod of the namespace" in problems
    assert "xpusense-collector: port grpc (7470) is let in by no policy" in problems
    without_deny = [d for d in docs if d["metadata"]["name"] != "default-deny-ingress"]
    assert "no default-deny ingress policy in namespace xpusense" in policy_problems(without_deny)
    no_policies = [d for d in docs if d["kind"] != "NetworkPolicy"]
    assert "xpusense-collector: selected by no NetworkPolicy" in policy_problems(no_policies)


def test_nothing_listens_in_plaintext_or_unauthenticated_on_a_routable_address():
    for path in DEPLOY.rglob("*.yaml"):
        assert "allow_insecure" not in path.read_text(), f"deploy/{path.relative_to(DEPLOY)}: allow_insecure"
    cms = {doc["metadata"]["name"]: doc["data"] for _, doc in documents() if doc["kind"] == "ConfigMap"}
    assert insecure_listens(cms["xpusense-collector"]["collector.toml"]) == []
    assert insecure_listens('listen = "0.0.0.0:7470"\nallow_insecure = true\n') == [
        "allow_insecure = true on 0.0.0.0:7470", "0.0.0.0:7470: no TLS with client certificates or tokens"]
    agent = tomllib.loads(cms["xpusense-agent"]["agent.toml"])["collector"]
    assert not agent.get("insecure") and agent["tls_ca"] and agent["tls_cert"] and agent["tls_key"]


def test_daemonset_is_least_privilege_with_the_mounts_bcc_and_vendor_tools_need():
    ds = next(doc for _, doc in documents() if doc["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    c = spec["containers"][0]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert {"BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE"} <= set(sc["capabilities"]["add"])
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/debug", "/sys/kernel/tracing", "/lib/modules", "/usr/src", "/dev",
            "/var/lib/kubelet/pod-resources", "/usr/local/Ascend/driver", "/usr/local/sbin/npu-smi"} <= mounts
    assert {t["key"] for t in spec["tolerations"]} >= {"nvidia.com/gpu", "huawei.com/Ascend910"}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    env = {e["name"]: e for e in c["env"]}
    assert env["XPUSENSE_K8S_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["pod-resources"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"


def test_configs_in_the_configmaps_load_with_the_real_loaders(tmp_path):
    cms = {doc["metadata"]["name"]: doc["data"] for _, doc in documents() if doc["kind"] == "ConfigMap"}
    a = tmp_path / "agent.toml"
    a.write_text(cms["xpusense-agent"]["agent.toml"])
    cfg = load_agent(str(a), env={"XPUSENSE_K8S_NODE_NAME": "n1", "XPUSENSE_NODE_ID": "n1"})
    assert cfg.k8s.enabled and cfg.k8s.node_name == "n1"
    c = tmp_path / "collector.toml"
    c.write_text(cms["xpusense-collector"]["collector.toml"])
    ccfg = load_collector(str(c), env={})
    assert ccfg.export.prometheus.enabled and ccfg.export.prometheus.compat_names
    # The Service exposes what the collector listens on.
    svc = next(doc for _, doc in documents() if doc["kind"] == "Service")
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports == {"grpc": int(ccfg.listen.rsplit(":", 1)[1]),
                     "metrics": int(ccfg.export.prometheus.listen.rsplit(":", 1)[1]),
                     "extender": int(ccfg.kubernetes.extender.listen.rsplit(":", 1)[1])}
    assert ccfg.kubernetes.extender.enabled


def test_dockerfile_parses_and_installs_the_repo_with_debian_bcc():
    dfp = pytest.importorskip("dockerfile_parse", reason="dockerfile-parse is a dev dependency")
    parser = dfp.DockerfileParser(path=str(ROOT / "Dockerfile"))
    assert parser.baseimage.startswith("debian:bookworm")
    instrs = [(i["instruction"], i["value"]) for i in parser.structure]
    runs = " ".join(v for k, v in instrs if k == "RUN")
    assert "python3-bpfcc" in runs and "pip install ." in runs and "dist-packages/bcc" in runs
    for k, v in instrs:
        if k == "COPY":
            for src in v.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {v.split()[0].rstrip("/") for k, v in instrs if k == "COPY"}
    assert {d.split("/")[0] for d in dirs} <= copied, "a package folder is not copied into the image"
    cmd = parser.cmd if hasattr(parser, "cmd") else next(v for k, v in instrs if k == "CMD")
    assert "xpusense-agent" in str(cmd)
    # The manifests run the image's console scripts (the second kube-scheduler runs its own image).
    for _, doc in documents():
        if doc["kind"] in ("DaemonSet", "Deployment") and \
                doc["spec"]["template"]["spec"]["containers"][0]["image"].startswith("xpusense:"):
            command = doc["spec"]["template"]["spec"]["containers"][0]["command"][0]
            assert Path(command).name in pyproject["project"]["scripts"]


@pytest.fixture(scope="module")
def systemd_root(tmp_path_factory):
    """A file-system root for `systemd-analyze verify --root`: the system's unit directory (for
    the targets the units refer to), stub executables at the units' ExecStart paths, our units."""
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.skip("systemd-analyze is missing (Debian package systemd; scripts/setup.sh installs it)")
    system_units = next((p for p in ("/usr/lib/systemd/system", "/lib/systemd/system") if os.path.isdir(p)), None)
    if system_units is None:
        pytest.skip("no systemd unit directory on this host to verify against")
    root = tmp_path_factory.mktemp("sysroot")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        text = (ROOT / "systemd" / unit).read_text()
        for line in text.splitlines():
            if line.startswith("ExecStart="):
                path = root / line.split("=", 1)[1].split()[0].lstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("#!/bin/sh\nexit 0\n")
                path.chmod(0o755)
        (root / "etc/systemd/system" / unit).write_text(text)
    dropin = ROOT / "systemd/xpusense-agent-least-privilege.conf"   # docs/security.md's non-root drop-in
    if dropin.exists():
        d = root / "etc/systemd/system/xpusense-agent.service.d"
        d.mkdir()
        shutil.copy(dropin, d / "least-privilege.conf")
    return exe, root


def verify(exe, root, *units):
    return subprocess.run([exe, "verify", "--man=no", f"--root={root}", *units], capture_output=True, text=True,
                          timeout=60)


def test_systemd_units_verify(systemd_root):
    exe, root = systemd_root
    r = verify(exe, root, *UNITS)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0 and out == "", out


def test_systemd_verify_catches_a_bad_unit(systemd_root):
    exe, root = systemd_root
    bad = (ROOT / "systemd/xpusense-agent.service").read_text().replace("WatchdogSec=30s", "WatchdogSec=soon")
    (root / "etc/systemd/system/xpusense-bad.service").write_text(bad)
    r = verify(exe, root, "xpusense-bad.service")
    assert "Failed to parse" in r.stdout + r.stderr


def test_units_are_hardened_as_the_issue_asks():
    agent = (ROOT / "systemd/xpusense-agent.service").read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", agent, re.M))
    assert keys["Type"] == "notify" and keys["WatchdogSec"] and keys["Restart"] == "on-failure"
    assert keys["ProtectSystem"] == "strict" and keys["StateDirectory"] == "xpusense/spool"
    assert {"CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_SYS_RESOURCE"} <= set(keys["CapabilityBoundingSet"].split())
    assert keys["LimitMEMLOCK"] == "infinity" and keys["StandardOutput"] == "journal"
    # The spool the unit makes writable is the one the agent uses.
    assert "XPUSENSE_SPOOL_DIR=/var/lib/xpusense/spool" in agent
    coll = dict(re.findall(r"^(\w+)=(.*)$", (ROOT / "systemd/xpusense-collector.service").read_text(), re.M))
    assert coll["ProtectSystem"] == "strict" and "--data-dir /var/lib/xpusense/collector" in coll["ExecStart"]
    assert coll["StateDirectory"] == "xpusense/collector" and coll["CapabilityBoundingSet"] == ""


def test_the_checkpoint_request_dir_is_made_1777_where_the_agent_writes_it(tmp_path):
    """The DaemonSet's init container and the unit make the request dir 1777 (the jobs' helper adds
    its done files; the sticky bit keeps others' files theirs), and the agent accepts it."""
    from xpusense.agent.request_dir import prepare_request_dir
    cms = {doc["metadata"]["name"]: doc["data"] for _, doc in documents() if doc["kind"] == "ConfigMap"}
    request_dir = tomllib.loads(cms["xpusense-agent"]["agent.toml"])["hbm_watch"]["request_dir"]
    spec = next(doc for _, doc in documents() if doc["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "checkpoint-dir")
    agent = spec["containers"][0]
    vol = next(m["name"] for m in agent["volumeMounts"] if m["mountPath"] == request_dir)
    assert [m["mountPath"] for m in init["volumeMounts"] if m["name"] == vol] == [request_dir]
    hostpath = tmp_path / "checkpoint"
    hostpath.mkdir(mode=0o755)   # as the kubelet makes a DirectoryOrCreate hostPath
    subprocess.run([str(hostpath) if a == request_dir else a for a in init["command"]], check=True, timeout=30)
    assert oct(hostpath.stat().st_mode & 0o7777) == oct(0o1777)
    assert prepare_request_dir(str(hostpath)) is None
    unit = dict(re.findall(r"^(\w+)=(.*)$", (ROOT / "systemd/xpusense-agent.service").read_text(), re.M))
    assert f"/run/{unit['RuntimeDirectory']}" == load_agent(None, env={}).hbm_watch.request_dir
    assert unit["RuntimeDirectoryMode"] == "1777"
