from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_RAM: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]
    TIER_S3: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_RAM: Tier
TIER_REDIS: Tier
TIER_S3: Tier
TIER_DISK: Tier

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_length: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "data", "shm", "more", "total_length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    shm: ShmRange
    more: bool
    total_length: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRange, _Mapping]] = ..., more: _Optional[bool] = ..., total_length: _Optional[int] = ...) -> None: ...

class ShmRange(_message.Message):
    __slots__ = ("segment", "offset", "length", "seal_before_ns")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEAL_BEFORE_NS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    seal_before_ns: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., seal_before_ns: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "retain_ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    retain_ttl_s: float
    def __init__(self, namespace: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., retain_ttl_s: _Optional[float] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "rejected", "bytes_received", "tiers")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    rejected: int
    bytes_received: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierPutResult]
    def __init__(self, stored: _Optional[int] = ..., rejected: _Optional[int] = ..., bytes_received: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierPutResult, _Mapping]]] = ...) -> None: ...

class TierPutResult(_message.Message):
    __slots__ = ("tier", "name", "stored", "queued", "dropped", "failed", "deleted")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    name: str
    stored: int
    queued: int
    dropped: int
    failed: int
    deleted: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., name: _Optional[str] = ..., stored: _Optional[int] = ..., queued: _Optional[int] = ..., dropped: _Optional[int] = ..., failed: _Optional[int] = ..., deleted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "prefix_only", "shm", "accept_parts")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PARTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_only: bool
    shm: ShmTarget
    accept_parts: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefix_only: _Optional[bool] = ..., shm: _Optional[_Union[ShmTarget, _Mapping]] = ..., accept_parts: _Optional[bool] = ...) -> None: ...

class ShmTarget(_message.Message):
    __slots__ = ("segment", "capacity")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    segment: str
    capacity: int
    def __init__(self, segment: _Optional[str] = ..., capacity: _Optional[int] = ...) -> None: ...

class GetItem(_message.Message):
    __slots__ = ("index", "found", "data", "tier", "shm", "more")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    data: bytes
    tier: Tier
    shm: ShmRange
    more: bool
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., data: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., shm: _Optional[_Union[ShmRange, _Mapping]] = ..., more: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GetItem, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "tier", "used_bytes", "capacity_bytes", "blocks", "hits", "misses", "puts", "evictions", "rejected", "checksum_failures", "errors", "healthy", "promotions", "demotions", "write_errors", "queue_depth", "queue_bytes", "queue_dropped", "breaker", "skipped", "bytes_written", "bytes_read", "lookup_late_hits", "retained_blocks", "retained_bytes", "retention_refused", "retention_expired", "retention_copied", "retention_dropped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_LATE_HITS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_COPIED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_DROPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    checksum_failures: int
    errors: int
    healthy: bool
    promotions: int
    demotions: int
    write_errors: int
    queue_depth: int
    queue_bytes: int
    queue_dropped: int
    breaker: str
    skipped: int
    bytes_written: int
    bytes_read: int
    lookup_late_hits: int
    retained_blocks: int
    retained_bytes: int
    retention_refused: int
    retention_expired: int
    retention_copied: int
    retention_dropped: int
    def __init__(self, name: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[int] = ..., rejected: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., errors: _Optional[int] = ..., healthy: _Optional[bool] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., write_errors: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_bytes: _Optional[int] = ..., queue_dropped: _Optional[int] = ..., breaker: _Optional[str] = ..., skipped: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., lookup_late_hits: _Optional[int] = ..., retained_blocks: _Optional[int] = ..., retained_bytes: _Optional[int] = ..., retention_refused: _Optional[int] = ..., retention_expired: _Optional[int] = ..., retention_copied: _Optional[int] = ..., retention_dropped: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "tiers", "put_checksum_failures", "failed_requests", "max_block_bytes", "max_keys_per_request", "shm_bytes_received", "shm_bytes_sent", "inflight_bytes", "inflight_peak_bytes", "inflight_refused", "cut_off_calls", "bulk_bytes_received", "bulk_bytes_sent", "bulk_connections", "bulk_errors", "bulk_cut_off", "inplace_bytes_received", "inplace_bytes_leased", "arena_leases", "arena_reservations", "arena_leases_expired", "arena_reservations_reclaimed", "retention_refused", "retention_expired", "prefetch_queued", "prefetch_promoted", "prefetch_dropped", "prefetch_failed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PUT_CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CUT_OFF_CALLS_FIELD_NUMBER: _ClassVar[int]
    BULK_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BULK_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BULK_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    BULK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BULK_CUT_OFF_FIELD_NUMBER: _ClassVar[int]
    INPLACE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    INPLACE_BYTES_LEASED_FIELD_NUMBER: _ClassVar[int]
    ARENA_LEASES_FIELD_NUMBER: _ClassVar[int]
    ARENA_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ARENA_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ARENA_RESERVATIONS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FAILED_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    put_checksum_failures: int
    failed_requests: int
    max_block_bytes: int
    max_keys_per_request: int
    shm_bytes_received: int
    shm_bytes_sent: int
    inflight_bytes: int
    inflight_peak_bytes: int
    inflight_refused: int
    cut_off_calls: int
    bulk_bytes_received: int
    bulk_bytes_sent: int
    bulk_connections: int
    bulk_errors: int
    bulk_cut_off: int
    inplace_bytes_received: int
    inplace_bytes_leased: int
    arena_leases: int
    arena_reservations: int
    arena_leases_expired: int
    arena_reservations_reclaimed: int
    retention_refused: int
    retention_expired: int
    prefetch_queued: int
    prefetch_promoted: int
    prefetch_dropped: int
    prefetch_failed: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., put_checksum_failures: _Optional[int] = ..., failed_requests: _Optional[int] = ..., max_block_bytes: _Optional[int] = ..., max_keys_per_request: _Optional[int] = ..., shm_bytes_received: _Optional[int] = ..., shm_bytes_sent: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., inflight_peak_bytes: _Optional[int] = ..., inflight_refused: _Optional[int] = ..., cut_off_calls: _Optional[int] = ..., bulk_bytes_received: _Optional[int] = ..., bulk_bytes_sent: _Optional[int] = ..., bulk_connections: _Optional[int] = ..., bulk_errors: _Optional[int] = ..., bulk_cut_off: _Optional[int] = ..., inplace_bytes_received: _Optional[int] = ..., inplace_bytes_leased: _Optional[int] = ..., arena_leases: _Optional[int] = ..., arena_reservations: _Optional[int] = ..., arena_leases_expired: _Optional[int] = ..., arena_reservations_reclaimed: _Optional[int] = ..., retention_refused: _Optional[int] = ..., retention_expired: _Optional[int] = ..., prefetch_queued: _Optional[int] = ..., prefetch_promoted: _Optional[int] = ..., prefetch_dropped: _Optional[int] = ..., prefetch_failed: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "max_block_bytes", "max_keys_per_request", "shm_dir", "block_parts", "bulk_port", "bulk_host", "bulk_tls", "bulk_put_mem", "arena_path", "arena_bytes", "shm_socket", "server_uid", "presence_path", "instance_id", "sealed_puts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_PARTS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_HOST_FIELD_NUMBER: _ClassVar[int]
    BULK_TLS_FIELD_NUMBER: _ClassVar[int]
    BULK_PUT_MEM_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SERVER_UID_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PATH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEALED_PUTS_FIELD_NUMBER: _ClassVar[int]
    version: str
    max_block_bytes: int
    max_keys_per_request: int
    shm_dir: str
    block_parts: bool
    bulk_port: int
    bulk_host: str
    bulk_tls: bool
    bulk_put_mem: bool
    arena_path: str
    arena_bytes: int
    shm_socket: str
    server_uid: int
    presence_path: str
    instance_id: int
    sealed_puts: bool
    def __init__(self, version: _Optional[str] = ..., max_block_bytes: _Optional[int] = ..., max_keys_per_request: _Optional[int] = ..., shm_dir: _Optional[str] = ..., block_parts: _Optional[bool] = ..., bulk_port: _Optional[int] = ..., bulk_host: _Optional[str] = ..., bulk_tls: _Optional[bool] = ..., bulk_put_mem: _Optional[bool] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., shm_socket: _Optional[str] = ..., server_uid: _Optional[int] = ..., presence_path: _Optional[str] = ..., instance_id: _Optional[int] = ..., sealed_puts: _Optional[bool] = ...) -> None: ...

class ArenaReserveRequest(_message.Message):
    __slots__ = ("namespace", "lengths")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ArenaSlot(_message.Message):
    __slots__ = ("id", "offset", "length")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    id: int
    offset: int
    length: int
    def __init__(self, id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ArenaReserveResponse(_message.Message):
    __slots__ = ("slots", "expires_in_s", "arena_path")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[ArenaSlot]
    expires_in_s: float
    arena_path: str
    def __init__(self, slots: _Optional[_Iterable[_Union[ArenaSlot, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., arena_path: _Optional[str] = ...) -> None: ...

class ArenaCommitItem(_message.Message):
    __slots__ = ("key", "reservation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    reservation: int
    def __init__(self, key: _Optional[bytes] = ..., reservation: _Optional[int] = ...) -> None: ...

class ArenaCommitRequest(_message.Message):
    __slots__ = ("namespace", "items", "abandon")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    items: _containers.RepeatedCompositeFieldContainer[ArenaCommitItem]
    abandon: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ArenaCommitItem, _Mapping]]] = ..., abandon: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseGetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "prefix_only")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_only: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class LeaseGetResponse(_message.Message):
    __slots__ = ("leases", "expires_in_s", "arena_path")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[ArenaSlot]
    expires_in_s: float
    arena_path: str
    def __init__(self, leases: _Optional[_Iterable[_Union[ArenaSlot, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., arena_path: _Optional[str] = ...) -> None: ...

class LeaseReleaseRequest(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leases: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("in_ram", "queued", "unknown", "dropped")
    IN_RAM_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    in_ram: int
    queued: int
    unknown: int
    dropped: int
    def __init__(self, in_ram: _Optional[int] = ..., queued: _Optional[int] = ..., unknown: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "timestamp_s", "kind", "tier", "namespace", "keys", "server_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp_s: float
    kind: KVEvent.Kind
    tier: Tier
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    server_id: str
    def __init__(self, sequence: _Optional[int] = ..., timestamp_s: _Optional[float] = ..., kind: _Optional[_Union[KVEvent.Kind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., server_id: _Optional[str] = ...) -> None: ...
