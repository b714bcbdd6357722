"""Worker configuration, built once at the edge (CLI / environment)."""

from dataclasses import dataclass

from worker_service.runtime.dtypes import DTYPE_CHOICES, check_device, normalize_dtype

PROPOSERS = ("none", "ngram", "draft", "suffix", "eagle3")
# k when --num-speculative-tokens is not given, per proposer: suffix and ngram as measured for the default model
# (bench/bench_goodput.py; the README's Benchmarks), draft the common choice (no draft model ships to measure).
DEFAULT_NUM_SPECULATIVE_TOKENS = {"none": 0, "ngram": 5, "draft": 5, "suffix": 16, "eagle3": 5}
# Proposers that may run together (`--proposer eagle3,suffix`): the copy-like ones, whose drafts carry no
# draft probabilities (proposers/combined.py); none and draft run alone.
COMBINABLE_PROPOSERS = ("ngram", "suffix", "eagle3")
# Proposers that draft trees with --draft-tree-width (proposers/trees.py); `draft` verifies with its own
# probabilities, which a tree's siblings would need corrected.
TREE_PROPOSERS = ("ngram", "suffix", "eagle3")
# What `specdec serve` and `specdec worker` speculate with unless --proposer says otherwise: the best measured
# for the default model at batch 1 (the goodput policy keeps it from costing throughput under load).
DEFAULT_PROPOSER = "suffix"
SCORERS = ("multi_query", "batch_expansion")


def proposer_names(proposer: str) -> tuple[str, ...]:
    """The proposers of a --proposer value ("eagle3,suffix" -> ("eagle3", "suffix")); ValueError names a bad one."""
    names = tuple(name.strip() for name in proposer.split(","))
    for name in names:
        if name not in PROPOSERS:
            raise ValueError(f"invalid proposer {name!r}: choose one of {', '.join(PROPOSERS)}, or several of "
                             f"{', '.join(COMBINABLE_PROPOSERS)} joined by commas")
    if len(names) > 1:
        alone = [n for n in names if n not in COMBINABLE_PROPOSERS]
        if alone:
            raise ValueError(f"proposer {alone[0]!r} runs alone; combine only {', '.join(COMBINABLE_PROPOSERS)}")
        if len(set(names)) < len(names):
            raise ValueError(f"proposer list {proposer!r} names one proposer twice")
    return names


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker loads and how it speculates."""

    model: str                          # checkpoint directory or .gguf file
    dtype: str = "auto"                 # DTYPE_CHOICES; the worker resolves "auto" when it loads the model
    device: str = "auto"                # check_device; build_worker resolves it (resolve_device)
    draft_model: str | None = None
    proposer: str = "none"
    num_speculative_tokens: int | None = None  # k: the most drafts per sequence and step; None: the proposer's
                                               # default (DEFAULT_NUM_SPECULATIVE_TOKENS)
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_cache_tokens: int = 65536    # the suffix proposer's index of recent outputs (0: none)
    forced_drafts: bool = True          # structured outputs: draft the tokens a constraint forces
    draft_previews: bool = False        # ngram, suffix: report each sequence's next match (proposers/preview.py)
    draft_tree_width: int = 1           # ngram, suffix, eagle3: most children per draft (1: chains; trees.py)
    scorer: str = "multi_query"
    kv_cache_memory_bytes: int = 2 << 30   # the KV budget; on CUDA build_worker sets it from the next field
    gpu_memory_utilization: float = 0.9    # on CUDA: the fraction of the GPU's memory the worker uses in all
    max_model_len: int | None = None    # None: the model's own limit
    num_threads: int | None = None      # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))  # frozen: set once, here
        object.__setattr__(self, "proposer", ",".join(proposer_names(self.proposer)))  # one spelling
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {self.scorer!r}")
        needs_model = [n for n in self.proposer_names if n in ("draft", "eagle3")]
        if needs_model and not self.draft_model:
            raise ValueError(f"proposer {needs_model[0]!r} needs a draft model (--draft-model: "
                             f"{'a checkpoint' if needs_model[0] == 'draft' else 'an EAGLE-3 head directory'})")
        if self.num_speculative_tokens is None:  # frozen: set once, here
            object.__setattr__(self, "num_speculative_tokens",
                               max(DEFAULT_NUM_SPECULATIVE_TOKENS[n] for n in self.proposer_names))
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.proposer != "none" and self.num_speculative_tokens == 0:
            raise ValueError(f"proposer {self.proposer!r} needs num_speculative_tokens >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft_tree_width < 1:
            raise ValueError(f"draft_tree_width must be >= 1, got {self.draft_tree_width}")
        if self.draft_tree_width > 1 and not set(self.proposer_names) & set(TREE_PROPOSERS):
            raise ValueError(f"draft trees (draft_tree_width {self.draft_tree_width}) need a proposer that drafts "
                             f"them ({', '.join(TREE_PROPOSERS)}), got {self.proposer!r}")
        if self.draft_tree_width > 1 and self.scorer != "multi_query":
            raise ValueError(f"draft trees (draft_tree_width {self.draft_tree_width}) need the multi_query scorer, "
                             f"got {self.scorer}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        check_device(self.device)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def proposer_names(self) -> tuple[str, ...]:
        return proposer_names(self.proposer)
