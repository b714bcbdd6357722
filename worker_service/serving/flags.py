"""The worker's command-line flags and the WorkerConfig built from them (one place for both)."""

import argparse
import pathlib

from worker_service.runtime import default_model as models
from worker_service.speculation.config import COMBINABLE_PROPOSERS, DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_PROPOSER, PROPOSERS, SCORERS, WorkerConfig, proposer_names
from worker_service.runtime.dtypes import DEVICE_SPELLINGS, DTYPE_ALIASES, DTYPE_CHOICES, check_device, normalize_dtype

# Flags a launcher forwards to a worker process (`specdec serve`), by argparse dest.
FORWARDED = ("draft_model", "proposer", "num_speculative_tokens", "ngram_min", "ngram_max", "suffix_cache_tokens",
             "forced_drafts", "draft_previews", "draft_tree_width", "scorer", "dtype", "device", "max_model_len",
             "kv_cache_memory_gib", "gpu_memory_utilization")


def add_flags(p: argparse.ArgumentParser) -> None:
    """Adds the model, speculation and KV-memory flags (not --model, --host, --port or --num-threads)."""
    p.add_argument("--draft-model", default=None,
                   help="draft model (same vocabulary) for --proposer draft, or an EAGLE-3 head directory for "
                        "--proposer eagle3 (default: none)")
    p.add_argument("--proposer", type=_proposer, default=DEFAULT_PROPOSER, metavar="|".join(PROPOSERS),
                   help="none (plain decoding), ngram (prompt lookup), draft (a smaller model), suffix (the "
                        "request's own tokens and recent outputs on the worker) or eagle3 (an EAGLE-3 head reading "
                        "the target's hidden states, --draft-model; the default model's head ships with specdec); "
                        f"or several of {', '.join(COMBINABLE_PROPOSERS)} at once, comma-separated (e.g. "
                        "eagle3,suffix): per sequence and step, the draft expected to keep more tokens is scored")
    defaults = ", ".join(f"{name} {k}" for name, k in DEFAULT_NUM_SPECULATIVE_TOKENS.items() if k)
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"most drafts per sequence and step (default: the proposer's: {defaults})")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram tried")
    p.add_argument("--ngram-max", type=int, default=4, help="longest n-gram tried first")
    p.add_argument("--suffix-cache-tokens", type=int, default=65536, metavar="N",
                   help="tokens of recent outputs the suffix proposer indexes per worker, least recently used "
                        "evicted (0: only the request's own tokens)")
    p.add_argument("--forced-drafts", action=argparse.BooleanOptionalAction, default=True,
                   help="structured outputs: draft the tokens a request's constraint forces (keys, punctuation) "
                        "where its sequence may speculate; off: only the proposer's drafts (checked against the "
                        "constraint)")
    p.add_argument("--draft-previews", action=argparse.BooleanOptionalAction, default=False,
                   help="ngram and suffix: after each step, look up each sequence's next draft and tell the "
                        "scheduler its match length, on which its goodput policy plans k; off (default): the "
                        "policy plans on each sequence's recent acceptance alone")
    p.add_argument("--draft-tree-width", type=int, default=1, metavar="W",
                   help="ngram, suffix and eagle3: draft a tree of continuations, at most W per node, within the "
                        "scheduler's k (the target verifies all in one pass and keeps the path it agrees with); "
                        "1: chains")
    p.add_argument("--scorer", choices=SCORERS, default="multi_query",
                   help="how the target scores drafts: multi_query (one (k+1)-token query per sequence) or "
                        "batch_expansion (k+1 single-token rows)")
    aliases = ", ".join(f"{alias} = {name}" for alias, name in DTYPE_ALIASES.items())
    p.add_argument("--dtype", choices=DTYPE_CHOICES, type=normalize_dtype, default="auto",
                   help=f"weights and KV; auto: the checkpoint's dtype on a GPU; on the CPU a GGUF's own blocks "
                        f"when they are q8_0 or q4_1 (the default model: q4_1), else float32; q8_0, q4_1: "
                        f"llama.cpp's weight blocks, fp32 activations and KV, CPU only ({aliases})")
    p.add_argument("--device", type=_device, default="auto",
                   help=f"{DEVICE_SPELLINGS}: where the models run; auto: cuda:0 when there is a CUDA device")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="KV cache budget per worker on the CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="on CUDA: the fraction of the GPU's memory a worker uses in all (weights, activations, "
                        "KV cache); the KV cache gets what the weights leave")


def _proposer(value: str) -> str:
    """--proposer's type: one proposer or a comma-separated list of combinable ones."""
    try:
        return ",".join(proposer_names(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _device(value: str) -> str:
    """--device's type: the spelling is checked when the flag is parsed (also from SPECDEC_DEVICE)."""
    try:
        return check_device(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--device ")) from exc  # argparse names the flag


def config_from_args(args: argparse.Namespace, model_dir: str, num_threads: int | None) -> WorkerConfig:
    """The WorkerConfig of parsed flags; raises ValueError for a bad combination. EAGLE-3 on the default model
    without --draft-model reads the head that ships with specdec."""
    draft_model = args.draft_model
    is_default_model = pathlib.Path(model_dir) == models.default_model_path()
    if draft_model is None and is_default_model and "eagle3" in proposer_names(args.proposer):
        draft_model = str(models.DEFAULT_EAGLE3_HEAD)
    return WorkerConfig(model=model_dir, dtype=args.dtype, device=args.device, draft_model=draft_model,
                        proposer=args.proposer,
                        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                        ngram_max=args.ngram_max, suffix_cache_tokens=args.suffix_cache_tokens,
                        forced_drafts=args.forced_drafts, draft_previews=args.draft_previews,
                        draft_tree_width=args.draft_tree_width,
                        scorer=args.scorer,
                        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, num_threads=num_threads)


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `args` that add_flags defines, as a worker command line."""
    argv = []
    for name in FORWARDED:
        value, flag = getattr(args, name), name.replace('_', '-')
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    return argv
