"""The `[export.otlp]` config table, shared by the agent (direct export) and the collector."""

from __future__ import annotations

import re


def endpoint_check(v: str) -> str | None:
    if re.fullmatch(r"(https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-_]+):\d{1,5}/?", v):
        return None
    return "must be HOST:PORT or http(s)://HOST:PORT (the OTLP gRPC receiver, usually port 4317)"


def otlp_schema(collector: bool) -> dict:
    # Imported here: agent/config.py builds its schema with this while it is being imported.
    from .config import Key, positive
    from .otlp_export import headers_check
    schema = {
        "enabled": Key(bool, False, help="export metrics over OTLP gRPC"),
        "endpoint": Key(str, "127.0.0.1:4317", endpoint_check,
                        help="OTLP gRPC receiver; https:// means TLS (with the system's CAs)"),
        "insecure": Key(bool, True, help="plaintext gRPC (no TLS) unless the endpoint says https://"),
        "headers": Key(str, "", headers_check, help="KEY=VALUE,KEY=VALUE sent with every export (e.g. auth)"),
        "interval_s": Key((int, float), 5.0 if collector else 10.0, positive, help="how often queued points are sent"),
        "timeout_s": Key((int, float), 10.0, positive, help="one export call, the SDK's own retries included"),
        "backoff_max_s": Key((int, float), 30.0, positive, help="longest wait between two tries while the backend fails"),
        "max_request_points": Key(int, 5000, positive, help="points per export request (gRPC's 4 MiB default limit)"),
    }
    if collector:
        schema["queue_batches"] = Key(int, 10_000, positive,
                                      help="without data_dir: batches kept for the backend (oldest dropped, counted)")
    else:
        schema["queue_points"] = Key(int, 200_000, positive,
                                     help="points kept for the backend (oldest dropped, counted)")
        schema["only"] = Key(bool, False, help="export only over OTLP: no stream to a collector")
    return schema
