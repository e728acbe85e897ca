"""The collector's exporters (OTLP, Prometheus) wired to the fleet state and the durable store.

Order matters, so collector/cli.py calls, in this order: `Exporters.from_config(cfg, state)` right
after the state is made (inventory watchers see the store's replay), `use_store(store)` before the
store is opened (the OTLP reader is registered, so the replay does not delete segments it has not
exported), then `start()` after the replay and `stop()` at the end.
"""

from __future__ import annotations

import logging

from .grpc_server import BindError
from .inventory_book import InventoryBook
from .otlp_export import MemoryQueue, OtlpExport, StoreQueue
from .prometheus import PrometheusEndpoint

log = logging.getLogger("xpusense.collector.export")


class Exporters:
    def __init__(self, cfg, state):
        self.cfg = cfg
        self.state = state
        self.book = InventoryBook().watch(state) if (cfg.export.otlp.enabled or cfg.export.prometheus.enabled) else None
        self.store = None
        self.otlp_queue = None
        self.otlp = None
        self.prometheus = None

    @classmethod
    def from_config(cls, cfg, state) -> Exporters:
        return cls(cfg, state)

    def use_store(self, store) -> None:
        self.store = store
        if self.cfg.export.otlp.enabled:
            self.otlp_queue = StoreQueue(store)

    def start(self) -> None:
        """Raises grpc_server.BindError when the Prometheus port cannot be had."""
        e = self.cfg.export
        if e.otlp.enabled:
            if self.otlp_queue is None:
                self.otlp_queue = MemoryQueue(e.otlp.queue_batches).watch(self.state)
            self.otlp = OtlpExport(e.otlp, self.book, self.otlp_queue)
            self.otlp.start()
        if e.prometheus.enabled:
            self.prometheus = PrometheusEndpoint(e.prometheus, self.state, self.book)
            try:
                self.prometheus.start()
            except OSError as err:
                raise BindError(str(err)) from None

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.otlp is not None:
            self.otlp.stop()
