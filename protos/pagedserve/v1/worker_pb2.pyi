from pagedserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerMessage(_message.Message):
    __slots__ = ("registration", "result", "error", "leaving")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    registration: WorkerRegistration
    result: StepResult
    error: StepError
    leaving: Leaving
    def __init__(self, registration: _Optional[_Union[WorkerRegistration, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., leaving: _Optional[_Union[Leaving, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "kind", "message")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[StepError.Kind]
        BAD_PLAN: _ClassVar[StepError.Kind]
        STEP_FAILED: _ClassVar[StepError.Kind]
    KIND_UNSPECIFIED: StepError.Kind
    BAD_PLAN: StepError.Kind
    STEP_FAILED: StepError.Kind
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    kind: StepError.Kind
    message: str
    def __init__(self, step_id: _Optional[int] = ..., kind: _Optional[_Union[StepError.Kind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Leaving(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WorkerRegistration(_message.Message):
    __slots__ = ("model_id", "max_model_len", "device", "kv_geometry", "num_blocks", "num_cpu_blocks", "name")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    max_model_len: int
    device: str
    kv_geometry: KVGeometry
    num_blocks: int
    num_cpu_blocks: int
    name: str
    def __init__(self, model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., device: _Optional[str] = ..., kv_geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class KVGeometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "layer_windows")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layer_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "seed", "num_prompt_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: _generate_pb2.SamplingParams
    seed: int
    num_prompt_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("seq_id", "new_block_ids", "num_scheduled_tokens", "draft_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_seqs", "running", "finished_seq_ids", "preempted_seq_ids", "copies", "swap_out", "swap_in", "token_bitmasks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    running: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    preempted_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    token_bitmasks: _containers.RepeatedCompositeFieldContainer[TokenBitmask]
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., preempted_seq_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., token_bitmasks: _Optional[_Iterable[_Union[TokenBitmask, _Mapping]]] = ...) -> None: ...

class TokenBitmask(_message.Message):
    __slots__ = ("seq_id", "bitmask")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    bitmask: bytes
    def __init__(self, seq_id: _Optional[int] = ..., bitmask: _Optional[bytes] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprobs", "num_accepted_drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprobs: _generate_pb2.PositionLogprobs
    num_accepted_drafts: int
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_generate_pb2.PositionLogprobs, _Mapping]] = ..., num_accepted_drafts: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "tokens", "step_seconds", "idle_seconds", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    step_seconds: float
    idle_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., step_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "positions")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    positions: _containers.RepeatedCompositeFieldContainer[_generate_pb2.PositionLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[_generate_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...
