from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MetricKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METRIC_KIND_UNSPECIFIED: _ClassVar[MetricKind]
    GAUGE: _ClassVar[MetricKind]
    COUNTER: _ClassVar[MetricKind]
    HISTOGRAM: _ClassVar[MetricKind]
METRIC_KIND_UNSPECIFIED: MetricKind
GAUGE: MetricKind
COUNTER: MetricKind
HISTOGRAM: MetricKind

class AgentMessage(_message.Message):
    __slots__ = ("hello", "batch", "inventory", "series")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SERIES_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: Batch
    inventory: Inventory
    series: SeriesTable
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., series: _Optional[_Union[SeriesTable, _Mapping]] = ...) -> None: ...

class CollectorMessage(_message.Message):
    __slots__ = ("ack", "welcome")
    ACK_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    welcome: Welcome
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "boot_id", "agent_version", "inventory", "time_unix_nano", "batch_encodings")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    BATCH_ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    agent_version: str
    inventory: Inventory
    time_unix_nano: int
    batch_encodings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., time_unix_nano: _Optional[int] = ..., batch_encodings: _Optional[_Iterable[str]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("boot_id", "stored_up_to", "batch_encoding", "series_defined_up_to")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_UP_TO_FIELD_NUMBER: _ClassVar[int]
    BATCH_ENCODING_FIELD_NUMBER: _ClassVar[int]
    SERIES_DEFINED_UP_TO_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    stored_up_to: int
    batch_encoding: str
    series_defined_up_to: int
    def __init__(self, boot_id: _Optional[str] = ..., stored_up_to: _Optional[int] = ..., batch_encoding: _Optional[str] = ..., series_defined_up_to: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("boot_id", "seq", "duplicate")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    seq: int
    duplicate: bool
    def __init__(self, boot_id: _Optional[str] = ..., seq: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "counts", "sum", "count")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    count: int
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("name", "unit", "kind", "labels", "value", "time_unix_nano", "histogram", "series_ref")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    SERIES_REF_FIELD_NUMBER: _ClassVar[int]
    name: str
    unit: str
    kind: MetricKind
    labels: _containers.ScalarMap[str, str]
    value: float
    time_unix_nano: int
    histogram: Histogram
    series_ref: int
    def __init__(self, name: _Optional[str] = ..., unit: _Optional[str] = ..., kind: _Optional[_Union[MetricKind, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ..., time_unix_nano: _Optional[int] = ..., histogram: _Optional[_Union[Histogram, _Mapping]] = ..., series_ref: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "type", "severity", "device", "message", "attributes", "time_unix_nano")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    severity: str
    device: str
    message: str
    attributes: _containers.ScalarMap[str, str]
    time_unix_nano: int
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., severity: _Optional[str] = ..., device: _Optional[str] = ..., message: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., time_unix_nano: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("node_id", "boot_id", "seq", "samples", "events", "sent_unix_nano", "columns")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    seq: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    sent_unix_nano: int
    columns: bytes
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., seq: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., sent_unix_nano: _Optional[int] = ..., columns: _Optional[bytes] = ...) -> None: ...

class SeriesTable(_message.Message):
    __slots__ = ("boot_id", "defs")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    DEFS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    defs: bytes
    def __init__(self, boot_id: _Optional[str] = ..., defs: _Optional[bytes] = ...) -> None: ...

class SeriesDefs(_message.Message):
    __slots__ = ("series",)
    SERIES_FIELD_NUMBER: _ClassVar[int]
    series: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, series: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class Interconnect(_message.Message):
    __slots__ = ("type", "bandwidth")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    type: str
    bandwidth: str
    def __init__(self, type: _Optional[str] = ..., bandwidth: _Optional[str] = ...) -> None: ...

class Resource(_message.Message):
    __slots__ = ("type", "vendor", "model", "attributes", "interconnects", "id")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECTS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    type: str
    vendor: str
    model: str
    attributes: _containers.ScalarMap[str, str]
    interconnects: _containers.RepeatedCompositeFieldContainer[Interconnect]
    id: str
    def __init__(self, type: _Optional[str] = ..., vendor: _Optional[str] = ..., model: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., interconnects: _Optional[_Iterable[_Union[Interconnect, _Mapping]]] = ..., id: _Optional[str] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("hostname", "labels", "resources")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    labels: _containers.ScalarMap[str, str]
    resources: _containers.RepeatedCompositeFieldContainer[Resource]
    def __init__(self, hostname: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., resources: _Optional[_Iterable[_Union[Resource, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("node_id", "name_prefix", "page_size", "page_token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name_prefix: str
    page_size: int
    page_token: str
    def __init__(self, node_id: _Optional[str] = ..., name_prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SeriesView(_message.Message):
    __slots__ = ("name", "unit", "kind", "labels", "value", "time_unix_nano", "rate", "histogram")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    name: str
    unit: str
    kind: MetricKind
    labels: _containers.ScalarMap[str, str]
    value: float
    time_unix_nano: int
    rate: float
    histogram: Histogram
    def __init__(self, name: _Optional[str] = ..., unit: _Optional[str] = ..., kind: _Optional[_Union[MetricKind, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ..., time_unix_nano: _Optional[int] = ..., rate: _Optional[float] = ..., histogram: _Optional[_Union[Histogram, _Mapping]] = ...) -> None: ...

class NodeView(_message.Message):
    __slots__ = ("node_id", "boot_id", "connected", "last_seen_unix_nano", "stored_up_to", "batches_stored", "batches_duplicate", "inventory", "series", "events", "peer", "boot_tag", "series_total", "continued", "events_omitted", "diagnoses")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    STORED_UP_TO_FIELD_NUMBER: _ClassVar[int]
    BATCHES_STORED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SERIES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BOOT_TAG_FIELD_NUMBER: _ClassVar[int]
    SERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    connected: bool
    last_seen_unix_nano: int
    stored_up_to: int
    batches_stored: int
    batches_duplicate: int
    inventory: Inventory
    series: _containers.RepeatedCompositeFieldContainer[SeriesView]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    peer: str
    boot_tag: str
    series_total: int
    continued: bool
    events_omitted: int
    diagnoses: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., connected: _Optional[bool] = ..., last_seen_unix_nano: _Optional[int] = ..., stored_up_to: _Optional[int] = ..., batches_stored: _Optional[int] = ..., batches_duplicate: _Optional[int] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., series: _Optional[_Iterable[_Union[SeriesView, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., peer: _Optional[str] = ..., boot_tag: _Optional[str] = ..., series_total: _Optional[int] = ..., continued: _Optional[bool] = ..., events_omitted: _Optional[int] = ..., diagnoses: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes", "time_unix_nano", "next_page_token", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeView]
    time_unix_nano: int
    next_page_token: str
    counters: _containers.ScalarMap[str, int]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeView, _Mapping]]] = ..., time_unix_nano: _Optional[int] = ..., next_page_token: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("node_id", "name", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Point(_message.Message):
    __slots__ = ("time_unix_nano", "value")
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    time_unix_nano: int
    value: float
    def __init__(self, time_unix_nano: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...

class HistoryReply(_message.Message):
    __slots__ = ("unit", "points")
    UNIT_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    unit: str
    points: _containers.RepeatedCompositeFieldContainer[Point]
    def __init__(self, unit: _Optional[str] = ..., points: _Optional[_Iterable[_Union[Point, _Mapping]]] = ...) -> None: ...
