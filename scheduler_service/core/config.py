"""Configuration of the scheduler core."""

from dataclasses import dataclass

SCHEDULING_MODES = ("sync", "async")
SPECULATION_POLICIES = ("goodput", "fixed")  # policy.py: how each sequence's k is chosen
ROUTING_POLICIES = ("cache-aware", "least-loaded")  # cluster.py: which worker a new request goes to


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of one scheduler (one worker's KV pool).

    `scheduling="async"` lets the engine loop schedule step N+1 while step N is
    still in flight; "sync" requires each step's result before the next step.
    The scheduler's flags (cluster/options.py's SchedulerOptions) take the
    defaults of the settings they share with this class from its fields, so
    core tests run with the process's defaults; num_kv_blocks, max_model_len
    and num_speculative_tokens the process derives from each worker instead.
    """

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_speculative_tokens: int = 0  # server k; 0 = no speculation
    speculative_disable_queue_size: int | None = None  # None = never auto-disable
    speculation_policy: str = "goodput"
    max_draft_tree_width: int = 1  # the worker's --draft-tree-width (1: chains only)
    scheduling: str = "async"
    enable_prefix_caching: bool = True
    # What besides the tokens makes the worker's KV what it is (model, dtype, draft model): the root of the
    # prefix cache's hash chains (block_hash.cache_root), so KV of another model or dtype is never a hit.
    kv_cache_facts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output token), got {self.max_model_len}"
            )
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_disable_queue_size is not None and self.speculative_disable_queue_size < 1:
            raise ValueError(
                "speculative_disable_queue_size must be >= 1 or None (never disable), "
                f"got {self.speculative_disable_queue_size}"
            )
        if self.speculation_policy not in SPECULATION_POLICIES:
            raise ValueError(
                f"speculation_policy must be one of {SPECULATION_POLICIES}, got {self.speculation_policy!r}"
            )
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {self.scheduling!r}")

    @property
    def is_async(self) -> bool:
        """Whether one step may be in flight while the next one is scheduled."""
        return self.scheduling == "async"
