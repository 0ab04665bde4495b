from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class EvictionPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVICTION_POLICY_UNSPECIFIED: _ClassVar[EvictionPolicy]
    EVICTION_POLICY_NONE: _ClassVar[EvictionPolicy]
    EVICTION_POLICY_STRICT: _ClassVar[EvictionPolicy]
    EVICTION_POLICY_GREEDY: _ClassVar[EvictionPolicy]
    EVICTION_POLICY_SINK: _ClassVar[EvictionPolicy]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT8: DType
EVICTION_POLICY_UNSPECIFIED: EvictionPolicy
EVICTION_POLICY_NONE: EvictionPolicy
EVICTION_POLICY_STRICT: EvictionPolicy
EVICTION_POLICY_GREEDY: EvictionPolicy
EVICTION_POLICY_SINK: EvictionPolicy

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DecodeStepRequest(_message.Message):
    __slots__ = ("query", "new_key", "new_value", "key_cache", "value_cache", "num_query_heads", "num_kv_heads")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    NEW_KEY_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_FIELD_NUMBER: _ClassVar[int]
    KEY_CACHE_FIELD_NUMBER: _ClassVar[int]
    VALUE_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    query: Tensor
    new_key: Tensor
    new_value: Tensor
    key_cache: Tensor
    value_cache: Tensor
    num_query_heads: int
    num_kv_heads: int
    def __init__(self, query: _Optional[_Union[Tensor, _Mapping]] = ..., new_key: _Optional[_Union[Tensor, _Mapping]] = ..., new_value: _Optional[_Union[Tensor, _Mapping]] = ..., key_cache: _Optional[_Union[Tensor, _Mapping]] = ..., value_cache: _Optional[_Union[Tensor, _Mapping]] = ..., num_query_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ...) -> None: ...

class DecodeStepResponse(_message.Message):
    __slots__ = ("output", "new_key_cache", "new_value_cache")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NEW_KEY_CACHE_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_CACHE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    new_key_cache: Tensor
    new_value_cache: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., new_key_cache: _Optional[_Union[Tensor, _Mapping]] = ..., new_value_cache: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "open", "step", "rollback", "snapshot", "restore")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: OpenStream
    step: Step
    rollback: Rollback
    snapshot: SnapshotRequest
    restore: SnapshotChunk
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[OpenStream, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., rollback: _Optional[_Union[Rollback, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[SnapshotChunk, _Mapping]] = ...) -> None: ...

class OpenStream(_message.Message):
    __slots__ = ("backend", "dtype", "batch_size", "num_query_heads", "num_kv_heads", "head_dim", "num_layers", "policy", "window", "capacity", "sink_tokens", "prefill")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    backend: str
    dtype: DType
    batch_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    policy: EvictionPolicy
    window: int
    capacity: int
    sink_tokens: int
    prefill: _containers.RepeatedCompositeFieldContainer[LayerCache]
    def __init__(self, backend: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., batch_size: _Optional[int] = ..., num_query_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_layers: _Optional[int] = ..., policy: _Optional[_Union[EvictionPolicy, str]] = ..., window: _Optional[int] = ..., capacity: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[LayerCache, _Mapping]]] = ...) -> None: ...

class LayerCache(_message.Message):
    __slots__ = ("layer", "key", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    key: Tensor
    value: Tensor
    def __init__(self, layer: _Optional[int] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("layer", "query", "new_key", "new_value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    NEW_KEY_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    query: Tensor
    new_key: Tensor
    new_value: Tensor
    def __init__(self, layer: _Optional[int] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ..., new_key: _Optional[_Union[Tensor, _Mapping]] = ..., new_value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("count", "layer", "all_layers")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ALL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    count: int
    layer: int
    all_layers: bool
    def __init__(self, count: _Optional[int] = ..., layer: _Optional[int] = ..., all_layers: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("max_chunk_bytes",)
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_chunk_bytes: int
    def __init__(self, max_chunk_bytes: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "opened", "step", "rollback", "snapshot", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    opened: StreamOpened
    step: StepResult
    rollback: RollbackResult
    snapshot: SnapshotChunk
    error: Status
    def __init__(self, request_id: _Optional[int] = ..., opened: _Optional[_Union[StreamOpened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ..., rollback: _Optional[_Union[RollbackResult, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotChunk, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class StreamOpened(_message.Message):
    __slots__ = ("stream_id", "backend", "dtype", "policy", "window", "capacity", "sink_tokens", "num_layers", "bytes_reserved", "tokens_seen")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    backend: str
    dtype: DType
    policy: EvictionPolicy
    window: int
    capacity: int
    sink_tokens: int
    num_layers: int
    bytes_reserved: int
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stream_id: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., policy: _Optional[_Union[EvictionPolicy, str]] = ..., window: _Optional[int] = ..., capacity: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., bytes_reserved: _Optional[int] = ..., tokens_seen: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("status", "layer", "output", "tokens_seen", "resident", "first_position", "last_position", "evicted", "evicted_tokens", "compute_ns", "rollback_reach")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REACH_FIELD_NUMBER: _ClassVar[int]
    status: Status
    layer: int
    output: Tensor
    tokens_seen: int
    resident: int
    first_position: int
    last_position: int
    evicted: bool
    evicted_tokens: int
    compute_ns: int
    rollback_reach: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., layer: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., tokens_seen: _Optional[int] = ..., resident: _Optional[int] = ..., first_position: _Optional[int] = ..., last_position: _Optional[int] = ..., evicted: _Optional[bool] = ..., evicted_tokens: _Optional[int] = ..., compute_ns: _Optional[int] = ..., rollback_reach: _Optional[int] = ...) -> None: ...

class RollbackResult(_message.Message):
    __slots__ = ("status", "tokens_seen", "rollback_reach")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REACH_FIELD_NUMBER: _ClassVar[int]
    status: Status
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    rollback_reach: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., tokens_seen: _Optional[_Iterable[int]] = ..., rollback_reach: _Optional[_Iterable[int]] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("config", "tokens_seen", "layer", "offset", "key", "value", "key_scale", "value_scale", "encoding", "last", "checksum", "key_outliers", "key_channels", "key_calibration", "signature")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    KEY_SCALE_FIELD_NUMBER: _ClassVar[int]
    VALUE_SCALE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KEY_OUTLIERS_FIELD_NUMBER: _ClassVar[int]
    KEY_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    KEY_CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    config: OpenStream
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    layer: int
    offset: int
    key: Tensor
    value: Tensor
    key_scale: Tensor
    value_scale: Tensor
    encoding: str
    last: bool
    checksum: int
    key_outliers: Tensor
    key_channels: _containers.RepeatedScalarFieldContainer[int]
    key_calibration: Tensor
    signature: bytes
    def __init__(self, config: _Optional[_Union[OpenStream, _Mapping]] = ..., tokens_seen: _Optional[_Iterable[int]] = ..., layer: _Optional[int] = ..., offset: _Optional[int] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ..., key_scale: _Optional[_Union[Tensor, _Mapping]] = ..., value_scale: _Optional[_Union[Tensor, _Mapping]] = ..., encoding: _Optional[str] = ..., last: _Optional[bool] = ..., checksum: _Optional[int] = ..., key_outliers: _Optional[_Union[Tensor, _Mapping]] = ..., key_channels: _Optional[_Iterable[int]] = ..., key_calibration: _Optional[_Union[Tensor, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "default_backend", "default_dtype", "backends", "limits")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    version: str
    default_backend: str
    default_dtype: DType
    backends: _containers.RepeatedCompositeFieldContainer[BackendInfo]
    limits: Limits
    def __init__(self, version: _Optional[str] = ..., default_backend: _Optional[str] = ..., default_dtype: _Optional[_Union[DType, str]] = ..., backends: _Optional[_Iterable[_Union[BackendInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class BackendInfo(_message.Message):
    __slots__ = ("name", "available", "reasons", "dtypes", "devices", "max_head_dim")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    reasons: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    devices: _containers.RepeatedScalarFieldContainer[str]
    max_head_dim: int
    def __init__(self, name: _Optional[str] = ..., available: _Optional[bool] = ..., reasons: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., devices: _Optional[_Iterable[str]] = ..., max_head_dim: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_streams", "max_cache_bytes", "max_capacity", "max_layers", "max_heads", "max_head_dim", "max_batch_size", "max_message_bytes", "idle_timeout_seconds", "max_queued_steps", "cache_bytes_in_use", "active_streams")
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_HEADS_FIELD_NUMBER: _ClassVar[int]
    MAX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    max_streams: int
    max_cache_bytes: int
    max_capacity: int
    max_layers: int
    max_heads: int
    max_head_dim: int
    max_batch_size: int
    max_message_bytes: int
    idle_timeout_seconds: float
    max_queued_steps: int
    cache_bytes_in_use: int
    active_streams: int
    def __init__(self, max_streams: _Optional[int] = ..., max_cache_bytes: _Optional[int] = ..., max_capacity: _Optional[int] = ..., max_layers: _Optional[int] = ..., max_heads: _Optional[int] = ..., max_head_dim: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., idle_timeout_seconds: _Optional[float] = ..., max_queued_steps: _Optional[int] = ..., cache_bytes_in_use: _Optional[int] = ..., active_streams: _Optional[int] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("request_id", "open", "add", "step", "remove", "rollback", "snapshot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: BatchOpen
    add: BatchAdd
    step: BatchStep
    remove: BatchRemove
    rollback: BatchRollback
    snapshot: BatchSnapshot
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[BatchOpen, _Mapping]] = ..., add: _Optional[_Union[BatchAdd, _Mapping]] = ..., step: _Optional[_Union[BatchStep, _Mapping]] = ..., remove: _Optional[_Union[BatchRemove, _Mapping]] = ..., rollback: _Optional[_Union[BatchRollback, _Mapping]] = ..., snapshot: _Optional[_Union[BatchSnapshot, _Mapping]] = ...) -> None: ...

class BatchOpen(_message.Message):
    __slots__ = ("backend", "dtype", "num_query_heads", "num_kv_heads", "head_dim", "num_layers")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    dtype: DType
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    def __init__(self, backend: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_query_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class BatchAdd(_message.Message):
    __slots__ = ("id", "policy", "window", "capacity", "sink_tokens", "prefill", "restore", "more")
    ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    id: int
    policy: EvictionPolicy
    window: int
    capacity: int
    sink_tokens: int
    prefill: _containers.RepeatedCompositeFieldContainer[LayerCache]
    restore: SnapshotChunk
    more: bool
    def __init__(self, id: _Optional[int] = ..., policy: _Optional[_Union[EvictionPolicy, str]] = ..., window: _Optional[int] = ..., capacity: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[LayerCache, _Mapping]]] = ..., restore: _Optional[_Union[SnapshotChunk, _Mapping]] = ..., more: _Optional[bool] = ...) -> None: ...

class BatchStep(_message.Message):
    __slots__ = ("layer", "ids", "query", "new_key", "new_value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    NEW_KEY_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    query: Tensor
    new_key: Tensor
    new_value: Tensor
    def __init__(self, layer: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ..., new_key: _Optional[_Union[Tensor, _Mapping]] = ..., new_value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class BatchRemove(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchRollback(_message.Message):
    __slots__ = ("ids", "counts", "layer", "all_layers")
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ALL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    layer: int
    all_layers: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., layer: _Optional[int] = ..., all_layers: _Optional[bool] = ...) -> None: ...

class BatchSnapshot(_message.Message):
    __slots__ = ("id", "max_chunk_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    max_chunk_bytes: int
    def __init__(self, id: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("request_id", "opened", "added", "step", "removed", "rollback", "snapshot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    opened: BatchOpened
    added: BatchAdded
    step: BatchStepResult
    removed: BatchRemoved
    rollback: BatchRollbackResult
    snapshot: BatchSnapshotChunk
    def __init__(self, request_id: _Optional[int] = ..., opened: _Optional[_Union[BatchOpened, _Mapping]] = ..., added: _Optional[_Union[BatchAdded, _Mapping]] = ..., step: _Optional[_Union[BatchStepResult, _Mapping]] = ..., removed: _Optional[_Union[BatchRemoved, _Mapping]] = ..., rollback: _Optional[_Union[BatchRollbackResult, _Mapping]] = ..., snapshot: _Optional[_Union[BatchSnapshotChunk, _Mapping]] = ...) -> None: ...

class BatchOpened(_message.Message):
    __slots__ = ("session_id", "backend", "dtype", "num_query_heads", "num_kv_heads", "head_dim", "num_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    backend: str
    dtype: DType
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    def __init__(self, session_id: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_query_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class SequenceRefusal(_message.Message):
    __slots__ = ("index", "id", "status")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: int
    status: Status
    def __init__(self, index: _Optional[int] = ..., id: _Optional[int] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class BatchAdded(_message.Message):
    __slots__ = ("status", "id", "policy", "window", "capacity", "sink_tokens", "bytes_reserved", "tokens_seen")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    status: Status
    id: int
    policy: EvictionPolicy
    window: int
    capacity: int
    sink_tokens: int
    bytes_reserved: int
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., id: _Optional[int] = ..., policy: _Optional[_Union[EvictionPolicy, str]] = ..., window: _Optional[int] = ..., capacity: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., bytes_reserved: _Optional[int] = ..., tokens_seen: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchStepResult(_message.Message):
    __slots__ = ("status", "layer", "output", "tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach", "refusals", "compute_ns")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REACH_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    layer: int
    output: Tensor
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    resident: _containers.RepeatedScalarFieldContainer[int]
    first_position: _containers.RepeatedScalarFieldContainer[int]
    last_position: _containers.RepeatedScalarFieldContainer[int]
    evicted_tokens: _containers.RepeatedScalarFieldContainer[int]
    rollback_reach: _containers.RepeatedScalarFieldContainer[int]
    refusals: _containers.RepeatedCompositeFieldContainer[SequenceRefusal]
    compute_ns: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., layer: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., tokens_seen: _Optional[_Iterable[int]] = ..., resident: _Optional[_Iterable[int]] = ..., first_position: _Optional[_Iterable[int]] = ..., last_position: _Optional[_Iterable[int]] = ..., evicted_tokens: _Optional[_Iterable[int]] = ..., rollback_reach: _Optional[_Iterable[int]] = ..., refusals: _Optional[_Iterable[_Union[SequenceRefusal, _Mapping]]] = ..., compute_ns: _Optional[int] = ...) -> None: ...

class BatchRemoved(_message.Message):
    __slots__ = ("ids", "refusals")
    IDS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    refusals: _containers.RepeatedCompositeFieldContainer[SequenceRefusal]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., refusals: _Optional[_Iterable[_Union[SequenceRefusal, _Mapping]]] = ...) -> None: ...

class BatchRollbackResult(_message.Message):
    __slots__ = ("tokens_seen", "rollback_reach", "refusals")
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REACH_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    tokens_seen: _containers.RepeatedScalarFieldContainer[int]
    rollback_reach: _containers.RepeatedScalarFieldContainer[int]
    refusals: _containers.RepeatedCompositeFieldContainer[SequenceRefusal]
    def __init__(self, tokens_seen: _Optional[_Iterable[int]] = ..., rollback_reach: _Optional[_Iterable[int]] = ..., refusals: _Optional[_Iterable[_Union[SequenceRefusal, _Mapping]]] = ...) -> None: ...

class BatchSnapshotChunk(_message.Message):
    __slots__ = ("id", "status", "chunk")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    id: int
    status: Status
    chunk: SnapshotChunk
    def __init__(self, id: _Optional[int] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., chunk: _Optional[_Union[SnapshotChunk, _Mapping]] = ...) -> None: ...
