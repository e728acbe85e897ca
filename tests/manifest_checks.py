"""Checks on a deploy folder's manifests shared by tests/unit/test_deploy*.py: the NetworkPolicies
against the pods they are meant for (selectors that select, ports the containers have, every
workload behind a policy, default deny), and the collector's listen security in its ConfigMaps."""

from __future__ import annotations

import tomllib

from xpusense.common.config import split_host_port
from xpusense.common.tls import is_loopback_host

WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pods(docs: list[dict], namespace: str) -> list[dict]:
    """Each workload's pod template: name, labels, hostNetwork, container ports (name -> number)."""
    out = []
    for d in docs:
        if d["kind"] in WORKLOADS and d["metadata"].get("namespace") == namespace:
            spec = d["spec"]["template"]["spec"]
            ports = {p.get("name", str(p["containerPort"])): p["containerPort"]
                     for c in spec["containers"] for p in c.get("ports", [])}
            out.append({"name": d["metadata"]["name"], "labels": d["spec"]["template"]["metadata"]["labels"],
                        "host_network": bool(spec.get("hostNetwork")), "ports": ports})
    return out


def policy_problems(docs: list[dict], namespace: str = "xpusense") -> list[str]:
    """What is wrong with the folder's NetworkPolicies: [] when every workload is behind a policy, a
    default deny of ingress covers the namespace, each policy and each pod peer selects pods that
    exist, each allowed port is a port of the pods it is for, and each container port is let in by
    some policy (a hostNetwork pod is outside NetworkPolicy: it must declare no ports)."""
    problems: list[str] = []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"].get("namespace") == namespace]
    workloads = pods(docs, namespace)
    if not any(p["spec"]["podSelector"] == {} and "Ingress" in p["spec"].get("policyTypes", [])
               and not p["spec"].get("ingress") for p in policies):
        problems.append(f"no default-deny ingress policy in namespace {namespace}")
    allowed: dict[str, set[int]] = {w["name"]: set() for w in workloads}
    for w in workloads:
        if not any(selects(p["spec"]["podSelector"], w["labels"]) for p in policies):
            problems.append(f"{w['name']}: selected by no NetworkPolicy")
        if w["host_network"] and w["ports"]:
            problems.append(f"{w['name']}: hostNetwork with ports {sorted(w['ports'])}: no NetworkPolicy covers them")
    for p in policies:
        name, spec = p["metadata"]["name"], p["spec"]
        targets = [w for w in workloads if selects(spec["podSelector"], w["labels"])]
        if spec["podSelector"] and not targets:
            problems.append(f"policy {name}: its podSelector selects no pod of the namespace")
        for rule in spec.get("ingress") or []:
            for peer in rule.get("from") or []:
                if "podSelector" in peer and "namespaceSelector" not in peer and \
                        not any(selects(peer["podSelector"], w["labels"]) for w in workloads):
                    problems.append(f"policy {name}: peer {peer['podSelector']} selects no pod of the namespace")
            if not rule.get("ports"):
                problems.append(f"policy {name}: a rule without ports lets every port in")
            for port in rule.get("ports") or []:
                for w in targets:
                    number = w["ports"].get(port["port"]) if isinstance(port["port"], str) else port["port"]
                    if number not in w["ports"].values():
                        problems.append(f"policy {name}: port {port['port']} is not a port of {w['name']}")
                    else:
                        allowed[w["name"]].add(number)
    for w in workloads:
        if not w["host_network"]:
            for pname, number in w["ports"].items():
                if number not in allowed[w["name"]]:
                    problems.append(f"{w['name']}: port {pname} ({number}) is let in by no policy")
    return problems


def insecure_listens(collector_toml: str) -> list[str]:
    """Plaintext or unauthenticated listening on a routable address in a collector config: what the
    collector's start refuses unless `allow_insecure` says otherwise (collector/auth.py)."""
    cfg = tomllib.loads(collector_toml)
    host, _ = split_host_port(cfg.get("listen", "127.0.0.1:7470"))
    if is_loopback_host(host):
        return []
    out = []
    if cfg.get("allow_insecure"):
        out.append(f"allow_insecure = true on {cfg['listen']}")
    tls = cfg.get("tls", {})
    if not (tls.get("cert") and tls.get("key") and (tls.get("ca") or cfg.get("tokens_file"))):
        out.append(f"{cfg['listen']}: no TLS with client certificates or tokens")
    return out
