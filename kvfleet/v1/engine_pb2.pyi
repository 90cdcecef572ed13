from kvfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request", "decode_address", "transfer_id", "transfer_timeout_s", "skip_blocks")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    decode_address: str
    transfer_id: str
    transfer_timeout_s: float
    skip_blocks: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., decode_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transfer_timeout_s: _Optional[float] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("output", "transfer")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    output: GenerateResponse
    transfer: KVTransferResult
    def __init__(self, output: _Optional[_Union[GenerateResponse, _Mapping]] = ..., transfer: _Optional[_Union[KVTransferResult, _Mapping]] = ...) -> None: ...

class KVTransferResult(_message.Message):
    __slots__ = ("transfer_id", "num_blocks", "num_bytes", "seconds", "num_cached_tokens", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_blocks: int
    num_bytes: int
    seconds: float
    num_cached_tokens: int
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("transfer_id", "request_id", "prompt_token_ids", "cache_salt", "lora_id", "block_size", "num_blocks", "num_tokens", "dtype", "block_shape", "block_hashes", "first_block", "shm")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora_id: str
    block_size: int
    num_blocks: int
    num_tokens: int
    dtype: str
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    shm: KVSharedMemory
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., block_shape: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., shm: _Optional[_Union[KVSharedMemory, _Mapping]] = ...) -> None: ...

class KVSharedMemory(_message.Message):
    __slots__ = ("name", "host_id", "num_bytes", "reused", "layer_major")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    LAYER_MAJOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    host_id: str
    num_bytes: int
    reused: bool
    layer_major: bool
    def __init__(self, name: _Optional[str] = ..., host_id: _Optional[str] = ..., num_bytes: _Optional[int] = ..., reused: _Optional[bool] = ..., layer_major: _Optional[bool] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("block_index", "data")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    data: bytes
    def __init__(self, block_index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVTransferChunk(_message.Message):
    __slots__ = ("header", "block")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    header: KVTransferHeader
    block: KVBlockChunk
    def __init__(self, header: _Optional[_Union[KVTransferHeader, _Mapping]] = ..., block: _Optional[_Union[KVBlockChunk, _Mapping]] = ...) -> None: ...

class ReceiveKVResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class ImportedGenerateRequest(_message.Message):
    __slots__ = ("request", "transfer_id", "first_token_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    transfer_id: str
    first_token_id: int
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., transfer_id: _Optional[str] = ..., first_token_id: _Optional[int] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "cache_salt", "lora_id", "tenant", "fair_share_weight")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    lora_id: str
    tenant: str
    fair_share_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., tenant: _Optional[str] = ..., fair_share_weight: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stop_reason", "usage", "num_cached_tokens", "engine_id", "logprobs", "prompt_logprobs", "text_delta", "first_prompt_token_text", "token_text_ends")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FIRST_PROMPT_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXT_ENDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stop_reason: _common_pb2.StopReason
    usage: _common_pb2.Usage
    num_cached_tokens: int
    engine_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    text_delta: str
    first_prompt_token_text: str
    token_text_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., engine_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., text_delta: _Optional[str] = ..., first_prompt_token_text: _Optional[str] = ..., token_text_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadInfo(_message.Message):
    __slots__ = ("engine_id", "num_running", "num_waiting", "kv_cache_usage", "kv_blocks_total", "kv_blocks_free", "block_size", "epoch", "model_name", "max_model_len", "lora_adapters")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    epoch: str
    model_name: str
    max_model_len: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., epoch: _Optional[str] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
