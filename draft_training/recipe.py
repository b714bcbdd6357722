"""A training run's settings (TrainConfig) and their checks, without torch: `specdec train-draft --help` and its
defaults come from here, so the CLI starts without importing the model code."""

from dataclasses import dataclass, field

from draft_training import prompts

PRECISIONS = ("auto", "float32", "bfloat16")  # the head's matmuls in training (trainer.autocast_dtype)


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the defaults are the recipe of the head shipped for the default model."""

    model: str  # the target's checkpoint directory
    output: str  # where the head is written
    work_dir: str  # prompts, shards, checkpoint (resume from here)
    sources: tuple[str, ...] = prompts.SOURCES
    prompt_files: tuple[str, ...] = ()
    num_prompts: int = 1100  # from the packaged sources and files
    num_self_prompts: int = 900  # written by the target
    max_new_tokens: int = 192
    generation_batch_size: int = 64
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int | None = None
    draft_vocab_coverage: float = 0.98
    max_draft_vocab_size: int = 8192
    num_steps: int = 6  # draft steps unrolled in training (EAGLE-3's training-time test)
    soft_labels: bool = False  # the target's distribution as a second label (teacher.py)
    precision: str = "auto"  # the head's matmuls in training: PRECISIONS
    epochs: int = 3
    learning_rate: float = 1e-3
    batch_tokens: int = 1024
    eval_fraction: float = 0.05
    checkpoint_every: int = 100
    seed: int = 0
    meta: dict = field(default_factory=dict)  # recorded in training.json (e.g. the command line)

    def __post_init__(self):
        unknown = [s for s in self.sources if s not in prompts.SOURCES]
        if unknown:
            raise ValueError(f"unknown prompt source {unknown[0]!r}; choose from {', '.join(prompts.SOURCES)}")
        for name in (
            "max_new_tokens",
            "generation_batch_size",
            "max_draft_vocab_size",
            "num_steps",
            "epochs",
            "batch_tokens",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose from {', '.join(PRECISIONS)}")
        if not 0 < self.draft_vocab_coverage <= 1 or not 0 < self.eval_fraction < 1:
            raise ValueError("draft_vocab_coverage must be in (0, 1] and eval_fraction in (0, 1)")
