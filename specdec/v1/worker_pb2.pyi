from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("block_size",)
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    def __init__(self, block_size: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_model_len", "kv_bytes_per_block", "num_blocks_capacity", "eos_token_ids", "dtype", "proposer", "max_num_speculative_tokens", "draft_model_id", "scorer", "device", "max_draft_tree_width", "step_port")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    STEP_PORT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_model_len: int
    kv_bytes_per_block: int
    num_blocks_capacity: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    proposer: str
    max_num_speculative_tokens: int
    draft_model_id: str
    scorer: str
    device: str
    max_draft_tree_width: int
    step_port: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., num_blocks_capacity: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., proposer: _Optional[str] = ..., max_num_speculative_tokens: _Optional[int] = ..., draft_model_id: _Optional[str] = ..., scorer: _Optional[str] = ..., device: _Optional[str] = ..., max_draft_tree_width: _Optional[int] = ..., step_port: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_blocks", "block_size", "previous_session_id", "take_over")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    previous_session_id: str
    take_over: bool
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., previous_session_id: _Optional[str] = ..., take_over: _Optional[bool] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ("kv_cache_bytes", "session_id")
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    kv_cache_bytes: int
    session_id: str
    def __init__(self, kv_cache_bytes: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class RequestSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TopTokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_new_tokens", "num_speculative_tokens", "num_computed_tokens", "grammar", "draft_tree_width")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: RequestSampling
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: int
    num_speculative_tokens: int
    num_computed_tokens: int
    grammar: str
    draft_tree_width: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[RequestSampling, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., draft_tree_width: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_blocks_kept", "num_new_tokens", "num_speculative_tokens", "forced_drafts_only", "draft_tree_width")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_KEPT_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks_kept: int
    num_new_tokens: int
    num_speculative_tokens: int
    forced_drafts_only: bool
    draft_tree_width: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_blocks_kept: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., forced_drafts_only: _Optional[bool] = ..., draft_tree_width: _Optional[int] = ...) -> None: ...

class ExecuteModelRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "finished_request_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "num_draft_tokens", "num_accepted_tokens", "num_kv_written_tokens", "proposer", "num_forced_tokens_next", "next_draft", "draft_tree_depth", "accepted_draft_ranks", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_TOKENS_NEXT_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_draft_tokens: int
    num_accepted_tokens: int
    num_kv_written_tokens: int
    proposer: str
    num_forced_tokens_next: int
    next_draft: DraftPreview
    draft_tree_depth: int
    accepted_draft_ranks: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopTokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_kv_written_tokens: _Optional[int] = ..., proposer: _Optional[str] = ..., num_forced_tokens_next: _Optional[int] = ..., next_draft: _Optional[_Union[DraftPreview, _Mapping]] = ..., draft_tree_depth: _Optional[int] = ..., accepted_draft_ranks: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopTokenLogprobs, _Mapping]]] = ...) -> None: ...

class DraftPreview(_message.Message):
    __slots__ = ("num_drafts", "match_length")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    match_length: int
    def __init__(self, num_drafts: _Optional[int] = ..., match_length: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("propose_ms", "score_ms", "verify_ms", "total_ms", "num_speculating_seqs")
    PROPOSE_MS_FIELD_NUMBER: _ClassVar[int]
    SCORE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATING_SEQS_FIELD_NUMBER: _ClassVar[int]
    propose_ms: float
    score_ms: float
    verify_ms: float
    total_ms: float
    num_speculating_seqs: int
    def __init__(self, propose_ms: _Optional[float] = ..., score_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., num_speculating_seqs: _Optional[int] = ...) -> None: ...

class ExecuteModelResponse(_message.Message):
    __slots__ = ("step_id", "outputs", "stats")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    stats: StepStats
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...
