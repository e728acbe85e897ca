"""The collector's configuration schema (loaded by the same checked TOML loader as the agent's)."""

from __future__ import annotations

from xpusense.agent.config import DEFAULT_ADDRESS, Key, host_port, load, log_level, positive

COLLECTOR_SCHEMA = {
    "listen": Key(str, DEFAULT_ADDRESS, host_port, help="HOST:PORT for ingest, query and health"),
    "log_level": Key(str, "info", log_level),
    "history_s": Key((int, float), 900.0, positive, help="history kept per series"),
    "stale_s": Key((int, float), 10.0, positive, help="a node silent this long is shown as stale"),
    "events_kept": Key(int, 200, positive, help="recent events kept per node"),
    "max_message_bytes": Key(int, 16 * 1024 * 1024, positive),
    "marks_file": Key(str, "", help="record of stored sequence numbers, so a restarted collector "
                                    "never stores a resent batch twice (empty: memory only)"),
}

COLLECTOR_ENV = {"XPUSENSE_LISTEN": "listen"}


def load_collector(path: str | None = None, flags: dict | None = None, env: dict | None = None):
    return load(COLLECTOR_SCHEMA, path, env, COLLECTOR_ENV, flags)
