from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcceleratorType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCELERATOR_ANY: _ClassVar[AcceleratorType]
    ACCELERATOR_GPU: _ClassVar[AcceleratorType]
    ACCELERATOR_NPU: _ClassVar[AcceleratorType]

class DataResidency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_NONE: _ClassVar[DataResidency]
    RESIDENCY_REGION: _ClassVar[DataResidency]
    RESIDENCY_PROVINCE: _ClassVar[DataResidency]
ACCELERATOR_ANY: AcceleratorType
ACCELERATOR_GPU: AcceleratorType
ACCELERATOR_NPU: AcceleratorType
RESIDENCY_NONE: DataResidency
RESIDENCY_REGION: DataResidency
RESIDENCY_PROVINCE: DataResidency

class Weights(_message.Message):
    __slots__ = ("compute", "data_affinity", "disaster_tolerance", "compliance")
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    DATA_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    DISASTER_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    COMPLIANCE_FIELD_NUMBER: _ClassVar[int]
    compute: float
    data_affinity: float
    disaster_tolerance: float
    compliance: float
    def __init__(self, compute: _Optional[float] = ..., data_affinity: _Optional[float] = ..., disaster_tolerance: _Optional[float] = ..., compliance: _Optional[float] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("accelerator", "memory_bytes", "count", "same_domain", "allowed_regions", "data_region", "replica_zones", "residency", "data_province", "require_encryption", "require_attestation", "weights", "limit", "max_excluded")
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SAME_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_REGIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_REGION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ZONES_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    DATA_PROVINCE_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_ENCRYPTION_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    accelerator: AcceleratorType
    memory_bytes: int
    count: int
    same_domain: bool
    allowed_regions: _containers.RepeatedScalarFieldContainer[str]
    data_region: str
    replica_zones: _containers.RepeatedScalarFieldContainer[str]
    residency: DataResidency
    data_province: str
    require_encryption: bool
    require_attestation: bool
    weights: Weights
    limit: int
    max_excluded: int
    def __init__(self, accelerator: _Optional[_Union[AcceleratorType, str]] = ..., memory_bytes: _Optional[int] = ..., count: _Optional[int] = ..., same_domain: _Optional[bool] = ..., allowed_regions: _Optional[_Iterable[str]] = ..., data_region: _Optional[str] = ..., replica_zones: _Optional[_Iterable[str]] = ..., residency: _Optional[_Union[DataResidency, str]] = ..., data_province: _Optional[str] = ..., require_encryption: _Optional[bool] = ..., require_attestation: _Optional[bool] = ..., weights: _Optional[_Union[Weights, _Mapping]] = ..., limit: _Optional[int] = ..., max_excluded: _Optional[int] = ...) -> None: ...

class DimensionScore(_message.Message):
    __slots__ = ("dimension", "score", "weight", "weighted", "detail")
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    dimension: str
    score: float
    weight: float
    weighted: float
    detail: str
    def __init__(self, dimension: _Optional[str] = ..., score: _Optional[float] = ..., weight: _Optional[float] = ..., weighted: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class Penalty(_message.Message):
    __slots__ = ("reason", "device", "factor", "detail")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reason: str
    device: str
    factor: float
    detail: str
    def __init__(self, reason: _Optional[str] = ..., device: _Optional[str] = ..., factor: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class DeviceNote(_message.Message):
    __slots__ = ("device", "reason", "detail")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    device: str
    reason: str
    detail: str
    def __init__(self, device: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("node_id", "score", "dimensions", "devices", "accelerator_type", "model", "labels", "penalties", "excluded_devices", "domain")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PENALTIES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    score: float
    dimensions: _containers.RepeatedCompositeFieldContainer[DimensionScore]
    devices: _containers.RepeatedScalarFieldContainer[str]
    accelerator_type: str
    model: str
    labels: _containers.ScalarMap[str, str]
    penalties: _containers.RepeatedCompositeFieldContainer[Penalty]
    excluded_devices: _containers.RepeatedCompositeFieldContainer[DeviceNote]
    domain: str
    def __init__(self, node_id: _Optional[str] = ..., score: _Optional[float] = ..., dimensions: _Optional[_Iterable[_Union[DimensionScore, _Mapping]]] = ..., devices: _Optional[_Iterable[str]] = ..., accelerator_type: _Optional[str] = ..., model: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., penalties: _Optional[_Iterable[_Union[Penalty, _Mapping]]] = ..., excluded_devices: _Optional[_Iterable[_Union[DeviceNote, _Mapping]]] = ..., domain: _Optional[str] = ...) -> None: ...

class Exclusion(_message.Message):
    __slots__ = ("node_id", "reason", "detail", "devices")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    detail: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceNote]
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceNote, _Mapping]]] = ...) -> None: ...

class PlaceReply(_message.Message):
    __slots__ = ("candidates", "excluded", "excluded_counts", "nodes_total", "nodes_feasible", "weights", "time_unix_nano", "decision_us")
    class ExcludedCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NODES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NODES_FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    DECISION_US_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    excluded: _containers.RepeatedCompositeFieldContainer[Exclusion]
    excluded_counts: _containers.ScalarMap[str, int]
    nodes_total: int
    nodes_feasible: int
    weights: Weights
    time_unix_nano: int
    decision_us: float
    def __init__(self, candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., excluded: _Optional[_Iterable[_Union[Exclusion, _Mapping]]] = ..., excluded_counts: _Optional[_Mapping[str, int]] = ..., nodes_total: _Optional[int] = ..., nodes_feasible: _Optional[int] = ..., weights: _Optional[_Union[Weights, _Mapping]] = ..., time_unix_nano: _Optional[int] = ..., decision_us: _Optional[float] = ...) -> None: ...
