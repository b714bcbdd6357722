"""Worker configuration, built once at the edge (CLI / environment)."""

from dataclasses import dataclass

PROPOSERS = ("none", "ngram", "draft", "suffix")
SCORERS = ("multi_query", "batch_expansion")
DTYPE_NAMES = ("float32", "bfloat16", "float16")            # what a model runs in
DTYPE_ALIASES = {"half": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES, *DTYPE_ALIASES)      # what --dtype takes


def normalize_dtype(name: str) -> str:
    """The one spelling of a --dtype value: an alias becomes its dtype's name ("half" -> "float16")."""
    return DTYPE_ALIASES.get(name, name)


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device_type: str) -> str:
    """The dtype a model runs in. "auto": the checkpoint's dtype on an accelerator (float32 when the
    checkpoint names none we run), float32 on the CPU, where float32 is the fast and exact choice."""
    requested = normalize_dtype(requested)
    if requested != "auto":
        return requested
    if device_type != "cpu" and checkpoint_dtype in DTYPE_NAMES:
        return checkpoint_dtype
    return "float32"


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker loads and how it speculates."""

    model: str                          # checkpoint directory or .gguf file
    dtype: str = "auto"                 # DTYPE_CHOICES; the worker resolves "auto" when it loads the model
    draft_model: str | None = None
    proposer: str = "none"
    num_speculative_tokens: int = 0     # k: the most drafts per sequence and step
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_cache_tokens: int = 65536    # the suffix proposer's index of recent outputs (0: none)
    scorer: str = "multi_query"
    kv_cache_memory_bytes: int = 2 << 30
    max_model_len: int | None = None    # None: the model's own limit
    num_threads: int | None = None      # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))  # frozen: set once, here
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {self.scorer!r}")
        if self.proposer == "draft" and not self.draft_model:
            raise ValueError("proposer 'draft' needs a draft model (--draft-model)")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.proposer != "none" and self.num_speculative_tokens == 0:
            raise ValueError(f"proposer {self.proposer!r} needs num_speculative_tokens >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
