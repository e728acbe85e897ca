"""Every node's latest inventory, kept for the exporters' threads (OTLP, Prometheus).

FleetState lives on the collector's event loop thread; the exporters read from threads of their
own. A watcher on the state (FleetState.watchers, called on the loop thread after a Hello, an
inventory change or a replayed inventory) keeps an immutable copy here: the serialized inventory,
parsed again on the reader's side, so no thread ever reads a message another one is changing.
"""

from __future__ import annotations

import threading

from xpusense.v1 import telemetry_pb2 as pb


class InventoryBook:
    def __init__(self) -> None:
        self._raw: dict[str, bytes] = {}
        self._parsed: dict[str, tuple[bytes, pb.Inventory]] = {}
        self._lock = threading.Lock()

    def watch(self, state) -> InventoryBook:
        state.watchers.append(self._on_change)
        return self

    def _on_change(self, node, batch) -> None:
        if batch is None:
            self._raw[node.node_id] = node.inventory.SerializeToString()   # one dict store: atomic

    def get(self, node_id: str) -> pb.Inventory | None:
        raw = self._raw.get(node_id)
        if raw is None:
            return None
        with self._lock:
            got = self._parsed.get(node_id)
            if got is None or got[0] is not raw:
                got = self._parsed[node_id] = (raw, pb.Inventory.FromString(raw))
            return got[1]
