"""The fleet as its readers see it (the scheduler, ListNodes, Prometheus, OTLP export): nodes with
their inventory, latest series, events and open diagnoses. Implemented by the collector's FleetState
(state.py) and by the cluster's mirror of the `fleet` bucket (cluster/summary.py, cluster/scheduler.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from xpusense.v1 import telemetry_pb2 as pb


class FleetSeries(Protocol):
    """A node's series: what it is and its latest point."""

    @property
    def name(self) -> str: ...
    @property
    def unit(self) -> str: ...
    @property
    def kind(self) -> int: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def value(self) -> float: ...
    @property
    def time_ns(self) -> int: ...   # the agent's stamp
    @property
    def recv_ns(self) -> int: ...   # when it arrived, on the collector's clock (clock.py)
    @property
    def histogram(self) -> pb.Histogram | None: ...
    def rate(self) -> float: ...    # per second, for a counter (NaN otherwise or unknown)


class FleetNode(Protocol):
    """A node: its current boot, streams, inventory, series by (name, sorted labels), recent events
    (newest first) and open diagnoses (diagnosis id -> open Event, oldest first)."""

    @property
    def node_id(self) -> str: ...
    @property
    def boot_id(self) -> str: ...
    @property
    def streams(self) -> int: ...
    @property
    def last_seen_ns(self) -> int: ...
    @property
    def peer(self) -> str: ...
    @property
    def inventory(self) -> pb.Inventory: ...
    @property
    def stored_up_to(self) -> Mapping[str, int]: ...
    @property
    def batches_stored(self) -> int: ...
    @property
    def batches_duplicate(self) -> int: ...
    @property
    def series(self) -> Mapping[tuple, FleetSeries]: ...
    @property
    def events(self) -> Sequence[pb.Event]: ...
    @property
    def diagnoses(self) -> Mapping[str, pb.Event]: ...


class DiagnosesOpened(Protocol):
    @property
    def opened(self) -> Mapping[str, int]: ...   # rule -> diagnoses opened


# fn(node, change) on the loop thread: change None after a Hello or a new inventory, else what a
# stored batch brought (its `events`; a cluster replica's also carries their `received_ns`).
Watcher = Callable[[Any, Any], None]


class Fleet(Protocol):
    """The fleet: its nodes by id, the watchers called after every change, its clock (ns)."""

    @property
    def nodes(self) -> Mapping[str, FleetNode]: ...
    @property
    def watchers(self) -> list[Watcher]: ...
    @property
    def diagnoses(self) -> DiagnosesOpened: ...
    # True where a node comes with its latest values (the batch after an inventory is like any other).
    @property
    def readings_with_inventory(self) -> bool: ...
    def clock(self) -> int: ...
