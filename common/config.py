"""Checked configuration: one TOML file, then environment, then flags; every key against a schema.

An unknown key, a value of the wrong type or out of range raises ConfigError naming the key and
where it came from, which the CLIs turn into exit status 2. Schemas are data (nested dicts of
`Key`), declared beside the code that uses them, so `--help`, the docs and the checks cannot drift
apart. This module is a leaf: it imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import tomllib
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

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


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be greater than 0"


def between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if low <= v <= high else f"must be between {low:g} and {high:g}"
    return check


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


def addresses(v: str) -> list[str]:
    """HOST:PORT[,HOST:PORT...] as a list (spaces around commas allowed); ValueError names a bad one."""
    out = [a.strip() for a in v.split(",") if a.strip()]
    if not out:
        raise ValueError(f"{v!r} is not HOST:PORT[,HOST:PORT...] (e.g. 127.0.0.1:{DEFAULT_PORT})")
    for a in out:
        split_host_port(a)
    return out


def host_ports(v: str) -> str | None:
    return complaint_from(addresses)(v)


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
    return None if v.startswith("SIG") and hasattr(signal, v) else "must be a signal name such as SIGUSR1"


def log_level(v: str) -> str | None:
    return None if v.lower() in ("debug", "info", "warning", "error") else "must be debug, info, warning or error"


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
        else:
            out[k] = _value(spec, v, key, where)
    return out


def _value(spec: Key, v: Any, key: str, where: str) -> Any:
    """One checked value of a key; ConfigError names the key and where the value came from."""
    if spec.type is Table:
        if not isinstance(v, dict) or not all(isinstance(x, (str, int, float)) for x in v.values()):
            raise ConfigError(f"{where}: '{key}' must be a table of strings")
        table = Table({str(a): str(b) for a, b in v.items()})
        if spec.check and (why := spec.check(table)):
            raise ConfigError(f"{where}: '{key}' {why}")
        return table
    if spec.type is list:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"{where}: '{key}' must be a list of strings, got {v!r}")
        if spec.check and (why := spec.check(v)):
            raise ConfigError(f"{where}: '{key}' {why}")
        return list(v)
    types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    # bool is an int in Python; a number key must not accept true/false.
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where}: '{key}' must be {names}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}: '{key}' must be a finite number, got {v!r}")
    if spec.check and (why := spec.check(v)):
        raise ConfigError(f"{where}: '{key}' {why}, got {v!r}")
    return v


def _defaults(schema: dict) -> dict:
    return {k: _defaults(v) if isinstance(v, dict) else v.default for k, v in schema.items()}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        deep = isinstance(v, dict) and not isinstance(v, Table) and isinstance(base.get(k), dict)
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
    if isinstance(d, Table):
        return dict(d)
    if isinstance(d, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in d.items()})
    return d


def load(schema: dict, path: str | None, env: Mapping[str, str] | None = None,
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
        except RecursionError:
            raise ConfigError(f"{path}: tables or arrays nested too deeply to be a configuration") from None
        merged = _merge(merged, _check(schema, data, path))
    environ: Mapping[str, str] = os.environ if env is None else env
    for var, key in (env_map or {}).items():
        if environ.get(var):
            merged = _merge(merged, _check(schema, _nest({key: environ[var]}), f"environment {var}"))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    if given:
        merged = _merge(merged, _check(schema, _nest(given), "command line"))
    return _namespace(merged)


