"""Configuration: one TOML file, then environment, then flags; every key checked against a schema.

An unknown key, a value of the wrong type or out of range raises ConfigError naming the key and
the file, which the CLIs turn into exit status 2. The schemas are data (`AGENT_SCHEMA` here, the
collector's in collector/), so `--help`, the docs and the checks cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from types import SimpleNamespace
from typing import Any, Callable

DEFAULT_PORT = 7470
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"


class ConfigError(Exception):
    """A bad configuration; the message names the key and where it came from."""


@dataclasses.dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    default: Any
    check: Callable[[Any], str | None] | None = None  # returns a complaint, or None when fine
    help: str = ""


class Table(dict):
    """A table of free-form string keys and string values (e.g. node labels)."""


class RawTable(dict):
    """A table passed whole to the part that owns it, which checks it (e.g. [sources.ebpf])."""


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be greater than 0"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be 0 or more"


def complaint_from(parse: Callable[[Any], Any]) -> Callable[[Any], str | None]:
    """A check made of a parser that raises ValueError with the reason."""
    def check(v: Any) -> str | None:
        try:
            parse(v)
        except ValueError as e:
            return str(e)
        return None
    return check


def host_port(v: str) -> str | None:
    return complaint_from(split_host_port)(v)


def split_host_port(v: str) -> tuple[str, int]:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{v!r} is not HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    return host.strip("[]"), int(port)


def ratio(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be between 0 and 1"


def one_of(*allowed: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        items = v if isinstance(v, list) else [v]
        bad = [x for x in items if x not in allowed]
        return f"must be {', '.join(allowed)} (not {', '.join(map(repr, bad))})" if bad else None
    return check


def signal_name(v: str) -> str | None:
    import signal
    return None if v.startswith("SIG") and hasattr(signal, v) else "must be a signal name such as SIGUSR1"


def log_level(v: str) -> str | None:
    return None if v.lower() in ("debug", "info", "warning", "error") else "must be debug, info, warning or error"


def _rule_keys(default: bool) -> dict[str, Key]:
    """The HBM watch's rule; per-vendor tables leave a key unset (None) to use the general one."""
    d = (lambda v: v) if default else (lambda v: None)
    return {
        "threshold": Key((int, float), d(0.85), ratio, help="fire at or above this utilisation"),
        "window_s": Key((int, float), d(5.0), positive, help="...for this long"),
        "low_mark": Key((int, float), d(0.75), ratio, help="re-arm only after falling below this"),
        "cooldown_s": Key((int, float), d(600.0), non_negative, help="per job, between two requests"),
    }


def _ebpf_check(v: dict) -> str | None:
    from .sources.ebpf import config_with_defaults  # the probes own their keys
    return complaint_from(config_with_defaults)(v)


def _otlp_schema(collector: bool) -> dict:
    from .otlp_config import otlp_schema
    return otlp_schema(collector)


_POD_METADATA_DIRS = ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                      "/run/containers/storage/overlay-containers", "/var/lib/docker/containers")

AGENT_SCHEMA: dict[str, Any] = {
    "node_id": Key(str, "", help="node id; default: the host name"),
    "log_level": Key(str, "info", log_level),
    "labels": Key(Table, Table(), help="cloud, region, zone, price... sent with the inventory"),
    "collector": {
        "address": Key(str, DEFAULT_ADDRESS, host_port),
        # How the agent proves who it is and checks the collector (agent/tls.py, docs/security.md).
        "tls_ca": Key(str, "", help="CA that signed the collector's certificate (PEM); set: TLS"),
        "tls_cert": Key(str, "", help="this node's client certificate (PEM), with tls_key: mTLS"),
        "tls_key": Key(str, "", help="this node's private key (PEM, mode 0600)"),
        "token_file": Key(str, "", help="file holding this node's bearer token (xpusense-collector tokens)"),
        "insecure": Key(bool, False, help="allow plaintext to a non-loopback collector (warns)"),
    },
    "tiers": {
        "realtime_s": Key((int, float), 1.0, positive),
        "nearline_s": Key((int, float), 15.0, positive),
        "offline_s": Key((int, float), 300.0, positive),
        "timeout_ratio": Key((int, float), 0.8, lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
                             help="a source round is abandoned after this share of its tier's period"),
    },
    "spool": {
        "enabled": Key(bool, True, help="keep every batch on disk until the collector acknowledges it"),
        "dir": Key(str, "", help="default /var/lib/xpusense/spool as root, else ~/.local/state/xpusense/spool; "
                                 "one subdirectory per node id (env XPUSENSE_SPOOL_DIR)"),
        "max_bytes": Key(int, 256 * 2**20, positive, help="disk budget; over it the oldest batches are dropped and counted"),
        "segment_bytes": Key(int, 4 * 2**20, positive),
        "fsync": Key(str, "interval", one_of("batch", "interval", "never")),
        "fsync_interval_s": Key((int, float), 1.0, positive),
    },
    "stream": {
        "queue_batches": Key(int, 3600, positive, help="batches kept in memory while the collector is away"),
        "flush_s": Key((int, float), 0.2, positive),
        "max_samples_per_batch": Key(int, 5000, positive),
        "backoff_initial_s": Key((int, float), 0.2, positive),
        "backoff_max_s": Key((int, float), 10.0, positive),
    },
    "hbm_watch": {
        "enabled": Key(bool, True),
        "actions": Key(list, ["signal", "file", "event"], one_of("signal", "file", "event")),
        "signal": Key(str, "SIGUSR1", signal_name),
        "request_dir": Key(str, "/run/xpusense/checkpoint"),
        "group_by": Key(str, "auto", one_of("auto", "cgroup", "pgid", "pid")),
        **_rule_keys(True),
        "vendor": {"nvidia": _rule_keys(False), "huawei": _rule_keys(False)},
    },
    # Kubernetes pod attribution of process and cgroup series (agent/pods.py, docs/deploy.md).
    "k8s": {
        "enabled": Key(bool, False, help="label pid/cgroup series with their pod, namespace and container"),
        "node_name": Key(str, "", help="this node's Kubernetes name, sent as inventory label k8s_node "
                                       "(env XPUSENSE_K8S_NODE_NAME, from the downward API)"),
        "procfs": Key(str, "/proc", help="where /proc/PID/cgroup is read (the host's: hostPID)"),
        "pod_resources_socket": Key(str, "/var/lib/kubelet/pod-resources/kubelet.sock",
                                    help="kubelet pod-resources API (device assignments); empty: not used"),
        "metadata_dirs": Key(list, list(_POD_METADATA_DIRS), help="container runtimes' state dirs (pod names)"),
        "refresh_s": Key((int, float), 10.0, positive, help="pod-resources and cache refresh period"),
    },
    # The agent's own OTLP export (agent/otlp_export.py); usually the collector exports instead.
    "export": {"otlp": _otlp_schema(collector=False)},
    "sources": {
        "host": {
            "enabled": Key(bool, True),
            "procfs": Key(str, "/proc"),
            "netns": Key(str, "", help="read interfaces of this network namespace (default: the agent's)"),
            "disk_exclude": Key(str, r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p|mmcblk\d+p)\d+$"),
            "interface_include": Key(str, ""),
            "interface_exclude": Key(str, ""),
        },
        "nvml": {
            "enabled": Key(bool, True),
            "gpm": Key(bool, True, help="GPM metrics (HBM bandwidth, SM, tensor) on Hopper and newer"),
            "events": Key(bool, True, help="watch XID and ECC events"),
            "event_wait_ms": Key(int, 500, positive),
        },
        "ebpf": Key(RawTable, RawTable(), lambda v: _ebpf_check(v),
                    help="eBPF probes: keys in docs/ebpf.md (enabled, probes, tc_interfaces, ...)"),
        "npu_smi": {
            "enabled": Key(bool, True),
            "path": Key(str, "", help="npu-smi executable (default: the driver's install dirs, then PATH)"),
            "timeout_s": Key((int, float), 0.6, positive, help="budget of one realtime round of calls"),
            "offline_timeout_s": Key((int, float), 10.0, positive),
            "setup_timeout_s": Key((int, float), 15.0, positive),
            "max_workers": Key(int, 8, positive, help="npu-smi calls run at once"),
        },
    },
}


def _check(schema: dict, data: dict, where: str, prefix: str = "") -> dict:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in schema:
            known = ", ".join(sorted(f"{prefix}{n}" for n in schema))
            raise ConfigError(f"{where}: unknown key '{key}' (known here: {known})")
        spec = schema[k]
        if isinstance(spec, dict):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: '{key}' must be a table")
            out[k] = _check(spec, v, where, key + ".")
            continue
        if spec.type is RawTable:
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: '{key}' must be a table")
            if spec.check and (why := spec.check(v)):
                raise ConfigError(f"{where}: {why}")
            out[k] = RawTable(v)
            continue
        if spec.type is Table:
            if not isinstance(v, dict) or not all(isinstance(x, (str, int, float)) for x in v.values()):
                raise ConfigError(f"{where}: '{key}' must be a table of strings")
            out[k] = Table({str(a): str(b) for a, b in v.items()})
            continue
        if spec.type is list:
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"{where}: '{key}' must be a list of strings, got {v!r}")
            if spec.check and (why := spec.check(v)):
                raise ConfigError(f"{where}: '{key}' {why}")
            out[k] = list(v)
            continue
        types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
        # bool is an int in Python; a number key must not accept true/false.
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{where}: '{key}' must be {names}, got {v!r}")
        if spec.check and (why := spec.check(v)):
            raise ConfigError(f"{where}: '{key}' {why}, got {v!r}")
        out[k] = v
    return out


def _defaults(schema: dict) -> dict:
    return {k: _defaults(v) if isinstance(v, dict) else v.default for k, v in schema.items()}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        deep = isinstance(v, dict) and not isinstance(v, (Table, RawTable)) and isinstance(base.get(k), dict)
        out[k] = _merge(base[k], v) if deep else v
    return out


def _nest(dotted: dict[str, Any]) -> dict:
    out: dict = {}
    for key, v in dotted.items():
        cur = out
        *parents, last = key.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = v
    return out


def _namespace(d: dict) -> Any:
    if isinstance(d, (Table, RawTable)):
        return dict(d)
    if isinstance(d, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in d.items()})
    return d


def load(schema: dict, path: str | None, env: dict[str, str] | None = None,
         env_map: dict[str, str] | None = None, flags: dict[str, Any] | None = None) -> SimpleNamespace:
    """Defaults <- TOML file <- environment (env_map: VAR -> dotted key) <- flags (dotted key -> value)."""
    merged = _defaults(schema)
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except PermissionError:
            raise ConfigError(f"{path}: config file is not readable (permission denied)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        merged = _merge(merged, _check(schema, data, path))
    env = os.environ if env is None else env
    for var, key in (env_map or {}).items():
        if env.get(var):
            merged = _merge(merged, _check(schema, _nest({key: env[var]}), f"environment {var}"))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    if given:
        merged = _merge(merged, _check(schema, _nest(given), "command line"))
    return _namespace(merged)


AGENT_ENV = {"XPUSENSE_NODE_ID": "node_id", "XPUSENSE_COLLECTOR": "collector.address",
             "XPUSENSE_SPOOL_DIR": "spool.dir", "XPUSENSE_K8S_NODE_NAME": "k8s.node_name"}


def load_agent(path: str | None = None, flags: dict[str, Any] | None = None,
               env: dict[str, str] | None = None) -> SimpleNamespace:
    cfg = load(AGENT_SCHEMA, path, env, AGENT_ENV, flags)
    w = cfg.hbm_watch
    for vendor, r in [("", w)] + list(vars(w.vendor).items()):
        threshold = r.threshold if r.threshold is not None else w.threshold
        low = r.low_mark if r.low_mark is not None else w.low_mark
        if low > threshold:
            key = f"hbm_watch.{'vendor.' + vendor + '.' if vendor else ''}low_mark"
            raise ConfigError(f"{path or 'configuration'}: '{key}' ({low}) must not be above the threshold ({threshold})")
    if not cfg.node_id:
        cfg.node_id = socket.gethostname()
    if not cfg.spool.dir:
        cfg.spool.dir = ("/var/lib/xpusense/spool" if os.geteuid() == 0
                         else os.path.expanduser("~/.local/state/xpusense/spool"))
    return cfg
