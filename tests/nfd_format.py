"""Node Feature Discovery's feature-file format, written from its customization guide ("Local feature
source": input format, directives, 64 kB limit, dot files ignored) and the Kubernetes label syntax
nfd-master applies to the labels (qualified name: DNS-subdomain prefix, name of at most 63
characters; value of at most 63 characters): what is wrong with a file, line by line."""

from __future__ import annotations

import re
from datetime import datetime

MAX_FILE_BYTES = 65536
PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")
DIRECTIVES = ("expiry-time", "no-label", "no-feature")


def denied_namespace(prefix: str) -> bool:
    """nfd-master refuses kubernetes.io and k8s.io namespaces but its own (feature.node, profile.node)."""
    if prefix in ("feature.node.kubernetes.io", "profile.node.kubernetes.io") or \
            prefix.endswith((".feature.node.kubernetes.io", ".profile.node.kubernetes.io")):
        return False
    return prefix in ("kubernetes.io", "k8s.io") or prefix.endswith((".kubernetes.io", ".k8s.io"))


def feature_file_problems(text: str, now: datetime) -> list[str]:
    """[] for a file whose every feature line NFD turns into the node label it says, unexpired at `now`."""
    problems: list[str] = []
    if len(text.encode()) > MAX_FILE_BYTES:
        problems.append(f"{len(text.encode())} bytes: over NFD's {MAX_FILE_BYTES}-byte limit (file ignored)")
    expiry: datetime | None = None
    seen: set[str] = set()
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if line.startswith("# +"):
                key, eq, value = line[3:].partition("=")
                if key not in DIRECTIVES:
                    problems.append(f"line {n}: unknown directive {key!r}")
                elif key == "expiry-time":
                    if not eq or not RFC3339.fullmatch(value.strip()):
                        problems.append(f"line {n}: expiry-time {value!r} is not RFC 3339")
                    else:
                        expiry = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            continue
        if expiry is None:
            problems.append(f"line {n}: a feature before any # +expiry-time (it would never expire)")
        elif expiry <= now:
            problems.append(f"line {n}: expired at {expiry.isoformat()} (NFD ignores it)")
        key, eq, value = line.partition("=")
        if not eq:
            problems.append(f"line {n}: {key!r} has no value (NFD would label it 'true')")
        prefix, slash, name = key.rpartition("/")
        if not slash:
            problems.append(f"line {n}: {key!r} has no namespace (NFD prefixes feature.node.kubernetes.io/)")
        elif len(prefix) > 253 or not PREFIX.fullmatch(prefix) or denied_namespace(prefix):
            problems.append(f"line {n}: namespace {prefix!r} is not a DNS subdomain NFD accepts")
        if len(name) > 63 or not NAME.fullmatch(name):
            problems.append(f"line {n}: name {name!r} is not a label name (63 characters, [A-Za-z0-9._-])")
        if len(value) > 63 or not VALUE.fullmatch(value):
            problems.append(f"line {n}: value {value!r} is not a label value (63 characters, [A-Za-z0-9._-])")
        if key in seen:
            problems.append(f"line {n}: {key} again")
        seen.add(key)
    return problems


def feature_labels(text: str) -> dict[str, str]:
    """The file's `name=value` lines."""
    return dict(ln.strip().split("=", 1) for ln in text.split("\n") if ln.strip() and not ln.startswith("#"))
