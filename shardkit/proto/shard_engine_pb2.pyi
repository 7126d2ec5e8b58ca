from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_CODE_UNSPECIFIED: _ClassVar[StatusCode]
    STATUS_CODE_OK: _ClassVar[StatusCode]
    STATUS_CODE_INVALID_ARGUMENT: _ClassVar[StatusCode]
    STATUS_CODE_NOT_FOUND: _ClassVar[StatusCode]
    STATUS_CODE_FAILED_PRECONDITION: _ClassVar[StatusCode]
    STATUS_CODE_ABORTED: _ClassVar[StatusCode]
    STATUS_CODE_CANCELLED: _ClassVar[StatusCode]
    STATUS_CODE_RESOURCE_EXHAUSTED: _ClassVar[StatusCode]
    STATUS_CODE_UNAVAILABLE: _ClassVar[StatusCode]
    STATUS_CODE_INTERNAL: _ClassVar[StatusCode]
    STATUS_CODE_DEADLINE_EXCEEDED: _ClassVar[StatusCode]
    STATUS_CODE_UNIMPLEMENTED: _ClassVar[StatusCode]

class CacheResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_RESULT_UNSPECIFIED: _ClassVar[CacheResult]
    CACHE_RESULT_HIT: _ClassVar[CacheResult]
    CACHE_RESULT_MISS: _ClassVar[CacheResult]
STATUS_CODE_UNSPECIFIED: StatusCode
STATUS_CODE_OK: StatusCode
STATUS_CODE_INVALID_ARGUMENT: StatusCode
STATUS_CODE_NOT_FOUND: StatusCode
STATUS_CODE_FAILED_PRECONDITION: StatusCode
STATUS_CODE_ABORTED: StatusCode
STATUS_CODE_CANCELLED: StatusCode
STATUS_CODE_RESOURCE_EXHAUSTED: StatusCode
STATUS_CODE_UNAVAILABLE: StatusCode
STATUS_CODE_INTERNAL: StatusCode
STATUS_CODE_DEADLINE_EXCEEDED: StatusCode
STATUS_CODE_UNIMPLEMENTED: StatusCode
CACHE_RESULT_UNSPECIFIED: CacheResult
CACHE_RESULT_HIT: CacheResult
CACHE_RESULT_MISS: CacheResult

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "client")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    client: str
    def __init__(self, protocol_version: _Optional[str] = ..., client: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "server", "target", "server_id", "calls")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    server: str
    target: str
    server_id: str
    calls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[str] = ..., server: _Optional[str] = ..., target: _Optional[str] = ..., server_id: _Optional[str] = ..., calls: _Optional[_Iterable[str]] = ...) -> None: ...

class Call(_message.Message):
    __slots__ = ("rpc", "request")
    RPC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    rpc: str
    request: bytes
    def __init__(self, rpc: _Optional[str] = ..., request: _Optional[bytes] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("response", "status_code", "details", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    status_code: int
    details: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, response: _Optional[bytes] = ..., status_code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class NewEngineRequest(_message.Message):
    __slots__ = ("close_engine_ids",)
    CLOSE_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    close_engine_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, close_engine_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewEngineResponse(_message.Message):
    __slots__ = ("engine_id", "server_id", "closed_engine_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSED_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    server_id: str
    closed_engine_ids: bool
    def __init__(self, engine_id: _Optional[int] = ..., server_id: _Optional[str] = ..., closed_engine_ids: bool = ...) -> None: ...

class EngineRef(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    def __init__(self, engine_id: _Optional[int] = ...) -> None: ...

class CloseEngineResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: bool = ...) -> None: ...

class StructuredStatus(_message.Message):
    __slots__ = ("code", "message", "retryable", "metrics")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    code: StatusCode
    message: str
    retryable: bool
    metrics: MetricsResult
    def __init__(self, code: _Optional[_Union[StatusCode, str]] = ..., message: _Optional[str] = ..., retryable: bool = ..., metrics: _Optional[_Union[MetricsResult, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model_id", "shard_start", "shard_end", "total_layers", "recipe_json")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_START_FIELD_NUMBER: _ClassVar[int]
    SHARD_END_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RECIPE_JSON_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    shard_start: int
    shard_end: int
    total_layers: int
    recipe_json: str
    def __init__(self, model_id: _Optional[str] = ..., shard_start: _Optional[int] = ..., shard_end: _Optional[int] = ..., total_layers: _Optional[int] = ..., recipe_json: _Optional[str] = ...) -> None: ...

class LoadResult(_message.Message):
    __slots__ = ("status", "architecture")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    status: StructuredStatus
    architecture: str
    def __init__(self, status: _Optional[_Union[StructuredStatus, _Mapping]] = ..., architecture: _Optional[str] = ...) -> None: ...

class EngineCapabilities(_message.Message):
    __slots__ = ("architecture", "evidence_class", "total_layers", "shard_start", "shard_end", "hidden_size", "vocab_size", "dtype", "max_sessions", "max_kv_tokens", "supported_faults", "tolerance", "concurrent_calls", "relative_tolerance", "margin_tolerance")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_CLASS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_START_FIELD_NUMBER: _ClassVar[int]
    SHARD_END_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_FAULTS_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    CONCURRENT_CALLS_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    MARGIN_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    evidence_class: str
    total_layers: int
    shard_start: int
    shard_end: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_sessions: int
    max_kv_tokens: int
    supported_faults: _containers.RepeatedScalarFieldContainer[str]
    tolerance: float
    concurrent_calls: bool
    relative_tolerance: float
    margin_tolerance: float
    def __init__(self, architecture: _Optional[str] = ..., evidence_class: _Optional[str] = ..., total_layers: _Optional[int] = ..., shard_start: _Optional[int] = ..., shard_end: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., max_sessions: _Optional[int] = ..., max_kv_tokens: _Optional[int] = ..., supported_faults: _Optional[_Iterable[str]] = ..., tolerance: _Optional[float] = ..., concurrent_calls: bool = ..., relative_tolerance: _Optional[float] = ..., margin_tolerance: _Optional[float] = ...) -> None: ...

class EngineTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BoundaryBundle(_message.Message):
    __slots__ = ("session_id", "epoch", "epoch_decimal", "step", "step_decimal", "boundary_point", "architecture", "tensors", "token_id_sideband")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_DECIMAL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_DECIMAL_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_POINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_SIDEBAND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    epoch_decimal: str
    step: int
    step_decimal: str
    boundary_point: str
    architecture: str
    tensors: _containers.RepeatedCompositeFieldContainer[EngineTensor]
    token_id_sideband: TokenIds
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., epoch_decimal: _Optional[str] = ..., step: _Optional[int] = ..., step_decimal: _Optional[str] = ..., boundary_point: _Optional[str] = ..., architecture: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[EngineTensor, _Mapping]]] = ..., token_id_sideband: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenOutput(_message.Message):
    __slots__ = ("token_id", "margin")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    margin: float
    def __init__(self, token_id: _Optional[int] = ..., margin: _Optional[float] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "epoch_decimal", "step", "step_decimal", "token_ids", "bundle")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_DECIMAL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_DECIMAL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    epoch_decimal: str
    step: int
    step_decimal: str
    token_ids: TokenIds
    bundle: BoundaryBundle
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., epoch_decimal: _Optional[str] = ..., step: _Optional[int] = ..., step_decimal: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., bundle: _Optional[_Union[BoundaryBundle, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("status", "cache", "bundle", "token", "metrics")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    status: StructuredStatus
    cache: CacheResult
    bundle: BoundaryBundle
    token: TokenOutput
    metrics: MetricsResult
    def __init__(self, status: _Optional[_Union[StructuredStatus, _Mapping]] = ..., cache: _Optional[_Union[CacheResult, str]] = ..., bundle: _Optional[_Union[BoundaryBundle, _Mapping]] = ..., token: _Optional[_Union[TokenOutput, _Mapping]] = ..., metrics: _Optional[_Union[MetricsResult, _Mapping]] = ...) -> None: ...

class HealthResult(_message.Message):
    __slots__ = ("status", "serving")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    status: StructuredStatus
    serving: bool
    def __init__(self, status: _Optional[_Union[StructuredStatus, _Mapping]] = ..., serving: bool = ...) -> None: ...

class MetricsResult(_message.Message):
    __slots__ = ("prefill_calls", "decode_calls", "active_sessions", "kv_tokens")
    PREFILL_CALLS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALLS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_calls: int
    decode_calls: int
    active_sessions: int
    kv_tokens: int
    def __init__(self, prefill_calls: _Optional[int] = ..., decode_calls: _Optional[int] = ..., active_sessions: _Optional[int] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: float
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class LoadCall(_message.Message):
    __slots__ = ("engine_id", "request", "with_capabilities")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    WITH_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    request: LoadRequest
    with_capabilities: bool
    def __init__(self, engine_id: _Optional[int] = ..., request: _Optional[_Union[LoadRequest, _Mapping]] = ..., with_capabilities: bool = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("result", "error", "capabilities")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    result: LoadResult
    error: StructuredStatus
    capabilities: CapabilitiesResponse
    def __init__(self, result: _Optional[_Union[LoadResult, _Mapping]] = ..., error: _Optional[_Union[StructuredStatus, _Mapping]] = ..., capabilities: _Optional[_Union[CapabilitiesResponse, _Mapping]] = ...) -> None: ...

class CapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities", "error")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    capabilities: EngineCapabilities
    error: StructuredStatus
    def __init__(self, capabilities: _Optional[_Union[EngineCapabilities, _Mapping]] = ..., error: _Optional[_Union[StructuredStatus, _Mapping]] = ...) -> None: ...

class StepCall(_message.Message):
    __slots__ = ("engine_id", "request", "with_metrics")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    WITH_METRICS_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    request: StepRequest
    with_metrics: bool
    def __init__(self, engine_id: _Optional[int] = ..., request: _Optional[_Union[StepRequest, _Mapping]] = ..., with_metrics: bool = ...) -> None: ...

class CancelCall(_message.Message):
    __slots__ = ("engine_id", "session_id", "epoch", "epoch_decimal", "with_metrics")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_DECIMAL_FIELD_NUMBER: _ClassVar[int]
    WITH_METRICS_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    session_id: str
    epoch: int
    epoch_decimal: str
    with_metrics: bool
    def __init__(self, engine_id: _Optional[int] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., epoch_decimal: _Optional[str] = ..., with_metrics: bool = ...) -> None: ...

class ReleaseCall(_message.Message):
    __slots__ = ("engine_id", "session_id", "with_metrics")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_METRICS_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    session_id: str
    with_metrics: bool
    def __init__(self, engine_id: _Optional[int] = ..., session_id: _Optional[str] = ..., with_metrics: bool = ...) -> None: ...

class InjectFaultCall(_message.Message):
    __slots__ = ("engine_id", "fault", "with_metrics")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    WITH_METRICS_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    fault: Fault
    with_metrics: bool
    def __init__(self, engine_id: _Optional[int] = ..., fault: _Optional[_Union[Fault, _Mapping]] = ..., with_metrics: bool = ...) -> None: ...
