from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "mapping")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    mapping: int
    def __init__(self, session_id: _Optional[str] = ..., mapping: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("id_prefix", "name", "controller", "attached", "idle_seconds", "lease_seconds", "grace_seconds", "grace_left_seconds", "objects", "arena_bytes")
    ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRACE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    id_prefix: str
    name: str
    controller: str
    attached: bool
    idle_seconds: float
    lease_seconds: float
    grace_seconds: float
    grace_left_seconds: float
    objects: int
    arena_bytes: int
    def __init__(self, id_prefix: _Optional[str] = ..., name: _Optional[str] = ..., controller: _Optional[str] = ..., attached: _Optional[bool] = ..., idle_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., grace_seconds: _Optional[float] = ..., grace_left_seconds: _Optional[float] = ..., objects: _Optional[int] = ..., arena_bytes: _Optional[int] = ...) -> None: ...

class SessionList(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class SessionSelector(_message.Message):
    __slots__ = ("selector", "by")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    selector: str
    by: str
    def __init__(self, selector: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("session_id", "python_version", "cloudpickle_version", "jax_version", "sys_path", "cwd", "lease_seconds", "controller", "session_name", "grace_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    JAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYS_PATH_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    SESSION_NAME_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    python_version: str
    cloudpickle_version: str
    jax_version: str
    sys_path: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    lease_seconds: float
    controller: str
    session_name: str
    grace_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., python_version: _Optional[str] = ..., cloudpickle_version: _Optional[str] = ..., jax_version: _Optional[str] = ..., sys_path: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., controller: _Optional[str] = ..., session_name: _Optional[str] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class ConnectReply(_message.Message):
    __slots__ = ("sidecar_id", "hostname", "pid", "boot_id", "arena_path", "arena_size", "arena_nonce", "lease_seconds", "colocar_version", "link_path", "grace_seconds", "took_over")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARENA_NONCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLOCAR_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINK_PATH_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    hostname: str
    pid: int
    boot_id: str
    arena_path: str
    arena_size: int
    arena_nonce: str
    lease_seconds: float
    colocar_version: str
    link_path: str
    grace_seconds: float
    took_over: str
    def __init__(self, sidecar_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., boot_id: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_size: _Optional[int] = ..., arena_nonce: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., colocar_version: _Optional[str] = ..., link_path: _Optional[str] = ..., grace_seconds: _Optional[float] = ..., took_over: _Optional[str] = ...) -> None: ...

class KeepaliveReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("pickle", "blocks")
    PICKLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pickle: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDesc]
    def __init__(self, pickle: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[BlockDesc, _Mapping]]] = ...) -> None: ...

class BlockDesc(_message.Message):
    __slots__ = ("id", "offset", "nbytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    offset: int
    nbytes: int
    def __init__(self, id: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("session_id", "kind", "code_hash", "code", "args", "object_id", "method", "processes", "name", "consume_blocks", "object_name", "object_ttl_seconds", "call_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FUNCTION: _ClassVar[CallRequest.Kind]
        NEW_OBJECT: _ClassVar[CallRequest.Kind]
        METHOD: _ClassVar[CallRequest.Kind]
    FUNCTION: CallRequest.Kind
    NEW_OBJECT: CallRequest.Kind
    METHOD: CallRequest.Kind
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_HASH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_NAME_FIELD_NUMBER: _ClassVar[int]
    OBJECT_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: CallRequest.Kind
    code_hash: bytes
    code: bytes
    args: Payload
    object_id: int
    method: str
    processes: bool
    name: str
    consume_blocks: _containers.RepeatedScalarFieldContainer[int]
    object_name: str
    object_ttl_seconds: float
    call_id: int
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[_Union[CallRequest.Kind, str]] = ..., code_hash: _Optional[bytes] = ..., code: _Optional[bytes] = ..., args: _Optional[_Union[Payload, _Mapping]] = ..., object_id: _Optional[int] = ..., method: _Optional[str] = ..., processes: _Optional[bool] = ..., name: _Optional[str] = ..., consume_blocks: _Optional[_Iterable[int]] = ..., object_name: _Optional[str] = ..., object_ttl_seconds: _Optional[float] = ..., call_id: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session_id", "call_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., call_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoteError(_message.Message):
    __slots__ = ("exception", "type", "message", "traceback")
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    exception: bytes
    type: str
    message: str
    traceback: str
    def __init__(self, exception: _Optional[bytes] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class CallReply(_message.Message):
    __slots__ = ("result", "error", "object_id", "done")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    result: Payload
    error: RemoteError
    object_id: int
    done: bool
    def __init__(self, result: _Optional[_Union[Payload, _Mapping]] = ..., error: _Optional[_Union[RemoteError, _Mapping]] = ..., object_id: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("call", "credits", "stop")
    CALL_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    call: CallRequest
    credits: int
    stop: bool
    def __init__(self, call: _Optional[_Union[CallRequest, _Mapping]] = ..., credits: _Optional[int] = ..., stop: _Optional[bool] = ...) -> None: ...

class ObjectRef(_message.Message):
    __slots__ = ("session_id", "object_id", "object_name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    object_id: int
    object_name: str
    def __init__(self, session_id: _Optional[str] = ..., object_id: _Optional[int] = ..., object_name: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "sizes", "pool", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sizes: _containers.RepeatedScalarFieldContainer[int]
    pool: str
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., sizes: _Optional[_Iterable[int]] = ..., pool: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDesc]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockDesc, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "block_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("session_id", "block_id", "offset", "nbytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_id: int
    offset: int
    nbytes: int
    def __init__(self, session_id: _Optional[str] = ..., block_id: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("session_id", "total_bytes", "pool", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    total_bytes: int
    pool: str
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., total_bytes: _Optional[int] = ..., pool: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class LogPoll(_message.Message):
    __slots__ = ("session_id", "wait_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    wait_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class LogLines(_message.Message):
    __slots__ = ("lines",)
    LINES_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lines: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("name", "reserved", "used", "peak", "blocks", "largest_free", "allocated")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    PEAK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    reserved: int
    used: int
    peak: int
    blocks: int
    largest_free: int
    allocated: int
    def __init__(self, name: _Optional[str] = ..., reserved: _Optional[int] = ..., used: _Optional[int] = ..., peak: _Optional[int] = ..., blocks: _Optional[int] = ..., largest_free: _Optional[int] = ..., allocated: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("calls", "errors", "latency_p50_us", "latency_p99_us", "sessions", "objects", "in_flight", "pools", "uptime_seconds", "worker_processes", "abandoned_calls", "tenant", "quota_refusals")
    class QuotaRefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_US_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_US_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_CALLS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    calls: int
    errors: int
    latency_p50_us: float
    latency_p99_us: float
    sessions: int
    objects: int
    in_flight: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    uptime_seconds: float
    worker_processes: int
    abandoned_calls: int
    tenant: str
    quota_refusals: _containers.ScalarMap[str, int]
    def __init__(self, calls: _Optional[int] = ..., errors: _Optional[int] = ..., latency_p50_us: _Optional[float] = ..., latency_p99_us: _Optional[float] = ..., sessions: _Optional[int] = ..., objects: _Optional[int] = ..., in_flight: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., worker_processes: _Optional[int] = ..., abandoned_calls: _Optional[int] = ..., tenant: _Optional[str] = ..., quota_refusals: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("timeout_seconds", "wait")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    wait: bool
    def __init__(self, timeout_seconds: _Optional[float] = ..., wait: _Optional[bool] = ...) -> None: ...

class AdmitUpdate(_message.Message):
    __slots__ = ("position", "estimated_wait_seconds", "addresses", "tenant", "waiting", "machines")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MACHINES_FIELD_NUMBER: _ClassVar[int]
    position: int
    estimated_wait_seconds: float
    addresses: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    waiting: int
    machines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, position: _Optional[int] = ..., estimated_wait_seconds: _Optional[float] = ..., addresses: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ..., waiting: _Optional[int] = ..., machines: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class NodeTenant(_message.Message):
    __slots__ = ("name", "token", "arena", "calls", "processes", "sessions", "lease_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    arena: int
    calls: int
    processes: int
    sessions: int
    lease_seconds: float
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ..., arena: _Optional[int] = ..., calls: _Optional[int] = ..., processes: _Optional[int] = ..., sessions: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class NodeTenantReply(_message.Message):
    __slots__ = ("address", "machine")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    address: str
    machine: str
    def __init__(self, address: _Optional[str] = ..., machine: _Optional[str] = ...) -> None: ...

class NodeTenantName(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class NodeTenants(_message.Message):
    __slots__ = ("running", "exited", "machine")
    class ExitedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    running: _containers.RepeatedScalarFieldContainer[str]
    exited: _containers.ScalarMap[str, str]
    machine: str
    def __init__(self, running: _Optional[_Iterable[str]] = ..., exited: _Optional[_Mapping[str, str]] = ..., machine: _Optional[str] = ...) -> None: ...
