"""Worker configuration, built once at the edge (CLI / environment)."""

from dataclasses import dataclass

from specdec.config_flags import setting
from worker_service.runtime.dtypes import (
    DEFAULT_QUANTIZED_ACTIVATIONS,
    DEVICE_SPELLINGS,
    DTYPE_ALIASES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZED_ACTIVATIONS,
    check_device,
    normalize_dtype,
)

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
            raise ValueError(
                f"invalid proposer {name!r}: choose one of {', '.join(PROPOSERS)}, or several of "
                f"{', '.join(COMBINABLE_PROPOSERS)} joined by commas"
            )
    if len(names) > 1:
        alone = [n for n in names if n not in COMBINABLE_PROPOSERS]
        if alone:
            raise ValueError(f"proposer {alone[0]!r} runs alone; combine only {', '.join(COMBINABLE_PROPOSERS)}")
        if len(set(names)) < len(names):
            raise ValueError(f"proposer list {proposer!r} names one proposer twice")
    return names


def normalize_proposer(proposer: str) -> str:
    """The one spelling of a --proposer value ("eagle3, suffix" -> "eagle3,suffix"); ValueError names a bad one."""
    return ",".join(proposer_names(proposer))


_DEFAULT_KS = ", ".join(f"{name} {k}" for name, k in DEFAULT_NUM_SPECULATIVE_TOKENS.items() if k)
_ALIASES = ", ".join(f"{alias} = {name}" for alias, name in DTYPE_ALIASES.items())


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker loads and how it speculates.

    A field with a help text is also the worker's flag of that name (specdec/config_flags.py generates
    `specdec worker`'s and `specdec serve`'s flags from them); --model and --num-threads the CLI defines.
    """

    model: str  # checkpoint directory or .gguf file
    draft_model: str | None = setting(
        None,
        "draft model (same vocabulary) for --proposer draft, or an EAGLE-3 head directory for --proposer eagle3 "
        "(default: none)",
    )
    # A program that builds a WorkerConfig (training, tests) gets plain decoding; the command speculates.
    proposer: str = setting(
        "none",
        "none (plain decoding), ngram (prompt lookup), draft (a smaller model), suffix (the request's own tokens and "
        "recent outputs on the worker) or eagle3 (an EAGLE-3 head reading the target's hidden states, --draft-model; "
        f"the default model's head ships with specdec); or several of {', '.join(COMBINABLE_PROPOSERS)} at once, "
        "comma-separated (e.g. eagle3,suffix): per sequence and step, the draft expected to keep more tokens is scored",
        flag_default=DEFAULT_PROPOSER,
        parse=normalize_proposer,
        metavar="|".join(PROPOSERS),
    )
    # k: the most drafts per sequence and step; None: the proposer's default (DEFAULT_NUM_SPECULATIVE_TOKENS)
    num_speculative_tokens: int | None = setting(
        None, f"most drafts per sequence and step (default: the proposer's: {_DEFAULT_KS})", metavar="K"
    )
    ngram_min: int = setting(1, "shortest n-gram tried")
    ngram_max: int = setting(4, "longest n-gram tried first")
    suffix_cache_tokens: int = setting(
        65536,
        "tokens of recent outputs the suffix proposer indexes per worker, least recently used evicted (0: only the "
        "request's own tokens)",
        metavar="N",
    )
    forced_drafts: bool = setting(
        True,
        "structured outputs: draft the tokens a request's constraint forces (keys, punctuation) where its sequence "
        "may speculate; off: only the proposer's drafts (checked against the constraint)",
    )
    draft_previews: bool = setting(  # proposers/preview.py
        False,
        "ngram and suffix: after each step, look up each sequence's next draft and tell the scheduler its match "
        "length, on which its goodput policy plans k; off (default): the policy plans on each sequence's recent "
        "acceptance alone",
    )
    draft_tree_width: int = setting(  # proposers/trees.py
        1,
        "ngram, suffix and eagle3: draft a tree of continuations, at most W per node, within the scheduler's k (the "
        "target verifies all in one pass and keeps the path it agrees with); 1: chains",
        metavar="W",
    )
    scorer: str = setting(
        "multi_query",
        "how the target scores drafts: multi_query (one (k+1)-token query per sequence) or batch_expansion (k+1 "
        "single-token rows)",
        choices=SCORERS,
    )
    dtype: str = setting(  # the worker resolves "auto" when it loads the model
        "auto",
        "weights and KV; auto: the checkpoint's dtype on a GPU; on the CPU a GGUF's own blocks when they are q8_0 or "
        "q4_1 (the default model: q4_1), else float32; q8_0, q4_1: llama.cpp's weight blocks, KV by "
        f"--kv-cache-dtype, activations by --quantized-activations, CPU only ({_ALIASES})",
        choices=DTYPE_CHOICES,
        parse=normalize_dtype,
    )
    quantized_activations: str = setting(
        DEFAULT_QUANTIZED_ACTIVATIONS,
        "q8_0 and q4_1 (and the EAGLE-3 head's q8_0 on the CPU): how the linear layers take their inputs; int8: "
        "quantized per row in blocks of 32 and multiplied in integers (several times faster per row, batch "
        "invariant); fp32: exact, bitwise the fp32 model on the dequantised weights",
        choices=QUANTIZED_ACTIVATIONS,
    )
    kv_cache_dtype: str = setting(  # the target's ModelRunner resolves "auto" (dtypes.resolve_kv_cache_dtype)
        "auto",
        "the target's KV cache; auto: the model's activation dtype (float32 for q8_0 and q4_1); bfloat16 under a "
        "float32, q8_0 or q4_1 model on the CPU halves the cache and the attention's reads of it (llama.cpp keeps "
        "f16 by default); speculation stays lossless, plain decoding reading the same cache",
        choices=KV_CACHE_DTYPES,
    )
    device: str = setting(  # build_worker resolves it (resolve_device)
        "auto",
        f"{DEVICE_SPELLINGS}: where the models run; auto: cuda:0 when there is a CUDA device",
        parse=check_device,
    )
    max_model_len: int | None = setting(None, "prompt + output limit (default: the model's)")
    kv_cache_memory_bytes: int = setting(  # on CUDA: build_worker's, from the next field
        2 << 30, "KV cache budget per worker on the CPU", flag="--kv-cache-memory-gib", unit=2**30
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "on CUDA: the fraction of the GPU's memory a worker uses in all (weights, activations, KV cache); the KV "
        "cache gets what the weights leave",
        metavar="FRACTION",
    )
    batch_invariant: bool = setting(
        True,
        "on a GPU: the linear layers and RMSNorms run batch-invariant Triton kernels, so a row's logits do not "
        "depend on the batch and speculation emits plain decoding's tokens at any batch; --no-batch-invariant "
        "keeps cuBLAS and torch's kernels (faster, not lossless at batch > 1). The CPU is invariant either way",
    )
    enforce_eager: bool = setting(
        False,
        "on a GPU: run every step eagerly; by default decode and verify steps replay CUDA graphs, captured per "
        "padded batch size at first use",
        action="store_true",
    )
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))  # frozen: set once, here
        object.__setattr__(self, "proposer", normalize_proposer(self.proposer))  # one spelling
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(
                f"quantized_activations must be one of {QUANTIZED_ACTIVATIONS}, got {self.quantized_activations!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {self.scorer!r}")
        needs_model = [n for n in self.proposer_names if n in ("draft", "eagle3")]
        if needs_model and not self.draft_model:
            raise ValueError(
                f"proposer {needs_model[0]!r} needs a draft model (--draft-model: "
                f"{'a checkpoint' if needs_model[0] == 'draft' else 'an EAGLE-3 head directory'})"
            )
        if self.num_speculative_tokens is None:  # frozen: set once, here
            object.__setattr__(
                self, "num_speculative_tokens", max(DEFAULT_NUM_SPECULATIVE_TOKENS[n] for n in self.proposer_names)
            )
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.proposer != "none" and self.num_speculative_tokens == 0:
            raise ValueError(f"proposer {self.proposer!r} needs num_speculative_tokens >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft_tree_width < 1:
            raise ValueError(f"draft_tree_width must be >= 1, got {self.draft_tree_width}")
        if self.draft_tree_width > 1 and not set(self.proposer_names) & set(TREE_PROPOSERS):
            raise ValueError(
                f"draft trees (draft_tree_width {self.draft_tree_width}) need a proposer that drafts "
                f"them ({', '.join(TREE_PROPOSERS)}), got {self.proposer!r}"
            )
        if self.draft_tree_width > 1 and self.scorer != "multi_query":
            raise ValueError(
                f"draft trees (draft_tree_width {self.draft_tree_width}) need the multi_query scorer, got {self.scorer}"
            )
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
