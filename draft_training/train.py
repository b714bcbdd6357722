"""`specdec train-draft`: prompts -> the target's responses and features (our worker) -> an EAGLE-3 head.

Every stage leaves its result in the work directory, so a run that stops resumes where it was: the prompts
(`prompts.jsonl`), the conversations in shards (`shard-NNNNN.pt`, one per generation batch) and the training
checkpoint (`checkpoint.pt`, every `checkpoint_every` steps), and the minutes each stage took
(`minutes.json`, summed over the runs that resumed it: the card reports the whole work). The seed fixes the
prompts, the self-written prompts' sampling, the split, the initial weights and the batch order, so a run can be
repeated.
"""

from dataclasses import asdict
import json
import logging
import math
import pathlib
import platform
import random
import time

import torch
from tqdm import tqdm

from draft_training import card, dataset, prompts
from draft_training.generation import generate
from draft_training.head import TrainableHead, head_config
from draft_training.recipe import TrainConfig
from draft_training.teacher import TargetTail
from draft_training.trainer import Trainer
from specdec import step
from worker_service.runtime import device as devices
from worker_service.runtime.eagle3_head import default_aux_layers
from worker_service.speculation.config import WorkerConfig

logger = logging.getLogger(__name__)

SENTINEL = "\u0000specdec-user-turn\u0000"
SELF_PROMPT_MAX_TOKENS = 96
MAX_PROMPT_TOKENS = 1024  # longer prompts (from files) are left out: the KV cache is sized for this
BLOCK_SIZE = 16


class TrainingError(RuntimeError):
    """A run that cannot go on (no prompts, no target); the message says why in one line."""


def run(config: TrainConfig) -> dict:
    """The whole recipe (resuming what the work directory holds); returns the summary written next to the head."""
    from transformers import AutoTokenizer

    from worker_service.speculation.build import build_worker

    work = pathlib.Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    clock = _Minutes(work / "minutes.json")
    try:
        worker = build_worker(
            WorkerConfig(
                model=config.model,
                dtype=config.dtype,
                device=config.device,
                proposer="none",
                num_threads=config.num_threads,
            )
        )
        tokenizer = AutoTokenizer.from_pretrained(config.model)
    except (OSError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"cannot load the target {config.model}: {exc}") from exc
    blocks_per_request = -(-(MAX_PROMPT_TOKENS + max(config.max_new_tokens, SELF_PROMPT_MAX_TOKENS) + 1) // BLOCK_SIZE)
    worker.init_cache(config.generation_batch_size * blocks_per_request, BLOCK_SIZE)
    stop_ids = stop_token_ids(worker, tokenizer)
    prompt_list = _prompts(config, work, worker, tokenizer, stop_ids)
    clock.add("prompts_min")
    conversations = _conversations(
        config, work, worker, tokenizer, stop_ids, prompt_list, on_shard=lambda: clock.add("responses_min")
    )
    clock.add("responses_min")
    draft_to_target, coverage = dataset.draft_vocabulary(
        conversations, config.draft_vocab_coverage, config.max_draft_vocab_size
    )
    train, held_out = dataset.split(conversations, config.eval_fraction, config.seed)
    head, teacher = new_head(worker.target.model, draft_to_target, config)
    device = worker.target.device
    head = head.to(device)
    del worker
    trainer = Trainer(
        head, config, work / "checkpoint.pt", on_checkpoint=lambda: clock.add("train_min"), teacher=teacher
    )
    accuracy = trainer.fit(train, held_out)
    clock.add("train_min")
    head.save(pathlib.Path(config.output))
    summary = {
        "target_name": pathlib.Path(config.model).name,
        "machine": _machine(device),
        "num_threads": torch.get_num_threads(),
        "config": {k: v for k, v in asdict(config).items() if k != "meta"},
        **config.meta,
        "sources": prompts.licences(prompt_list),
        "num_conversations": len(conversations),
        "num_train_tokens": sum(len(c.token_ids) for c in train),
        "num_response_tokens": sum(len(c.token_ids) - c.num_prompt_tokens for c in conversations),
        "draft_vocab_size": len(draft_to_target),
        "draft_vocab_coverage": round(coverage, 4),
        "train_precision": str(trainer.autocast_dtype or torch.float32).removeprefix("torch."),
        "held_out_accuracy_by_position": accuracy,
        "minutes": {k: round(v, 1) for k, v in clock.totals.items()},
    }
    (pathlib.Path(config.output) / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (pathlib.Path(config.output) / "README.md").write_text(card.render(summary))
    return summary


class _Minutes:
    """Minutes spent per stage, kept in the work directory and summed over the runs that resumed it; `add`
    counts the time since the last `add` (or the start) towards a stage."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.totals: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
        self.mark = time.perf_counter()

    def add(self, stage: str) -> None:
        now = time.perf_counter()
        self.totals[stage] = self.totals.get(stage, 0.0) + (now - self.mark) / 60
        self.mark = now
        _write_atomically(self.path, json.dumps(self.totals) + "\n")


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes `path` so that an interrupted write is never taken for a finished file."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def _machine(device: torch.device) -> str:
    """Where the run trained, for the card: the GPU on CUDA (and its host's CPU), else the CPU's name."""
    if device.type == "cuda":
        return f"{devices.describe(device)}; host CPU {_cpu_name()}"
    return _cpu_name()


def _cpu_name() -> str:
    """The CPU's model name (what `lscpu` shows)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def new_head(target, draft_to_target: torch.Tensor, config: TrainConfig) -> tuple[TrainableHead, TargetTail | None]:
    """A head for `target` before training (seeded with config.seed) and, with config.soft_labels, its teacher."""
    aux_layers = default_aux_layers(target.config.num_hidden_layers)
    torch.manual_seed(config.seed)
    head = TrainableHead(
        head_config(target.config, len(draft_to_target), aux_layers),
        target.model.embed_tokens.weight,
        lm_head_weight(target),
        target.model.norm.weight,
        draft_to_target,
    )
    teacher = TargetTail(target, aux_layers, lm_head_weight(target), draft_to_target) if config.soft_labels else None
    return head, teacher


def lm_head_weight(model) -> torch.Tensor:
    """The target's output layer's weight [vocab, hidden] (its input embedding where the two are tied)."""
    weight = model.lm_head.weight if hasattr(model.lm_head, "weight") else None
    return weight if weight is not None and weight.dim() == 2 else model.model.embed_tokens.weight


def stop_token_ids(worker, tokenizer) -> set[int]:
    eos = worker.target.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def _chat(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _prompts(config, work, worker, tokenizer, stop_ids) -> list[prompts.Prompt]:
    path = work / "prompts.jsonl"
    if path.exists():
        return [prompts.Prompt(**json.loads(line)) for line in path.read_text().splitlines()]
    collected = prompts.collect(list(config.sources), list(config.prompt_files), config.num_prompts, config.seed)
    if "self" in config.sources and config.num_self_prompts:
        collected += write_self_prompts(
            worker,
            tokenizer,
            stop_ids,
            prompts.self_prompt_openers(config.num_self_prompts, config.seed),
            config.seed,
            config.generation_batch_size,
        )
    random.Random(config.seed).shuffle(collected)
    if not collected:
        raise TrainingError("no prompts: the sources and files gave none")
    _write_atomically(path, "".join(json.dumps(asdict(p)) + "\n" for p in collected))
    logger.info(
        "%d prompts (%s)", len(collected), ", ".join(f"{s}: {e['num_prompts']}" for s, e in _by_kind(collected).items())
    )
    return collected


def _by_kind(collected):
    kinds = {}
    for p in collected:
        kinds.setdefault(p.source.split(":")[0], {"num_prompts": 0})["num_prompts"] += 1
    return kinds


def write_self_prompts(
    worker, tokenizer, stop_ids, openers: list[str], seed: int, batch_size: int
) -> list[prompts.Prompt]:
    """Prompts the target writes in a user turn of its chat template, the i-th started with openers[i] ("":
    empty; prompts.self_prompt_openers), sampled and keyed by the seed; duplicates and short ones dropped."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    turn_start = rendered.split(SENTINEL)[0]
    turns = [tokenizer(turn_start + opener, add_special_tokens=False)["input_ids"] for opener in openers]
    progress = tqdm(total=len(turns), desc="self-written prompts", unit="prompt")
    written = generate(
        worker,
        turns,
        SELF_PROMPT_MAX_TOKENS,
        stop_ids,
        lambda i: step.RequestSampling(temperature=1.0, top_p=0.95, seed=seed * 100003 + i),
        batch_size,
        on_batch=lambda done: progress.update(len(done)),
    )
    progress.close()
    prefix_chars = len(
        tokenizer.decode(tokenizer(turn_start, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    )
    texts = {tokenizer.decode(c.token_ids, skip_special_tokens=True)[prefix_chars:].strip() for c in written}
    return [prompts.Prompt(t, "self", "the target's own output") for t in sorted(texts) if len(t) >= 20]


def _conversations(config, work, worker, tokenizer, stop_ids, prompt_list, on_shard) -> list:
    """The target's greedy responses with their features; shards already in the work directory are kept."""
    worker.target.aux_layers = default_aux_layers(worker.target.model.config.num_hidden_layers)
    size = config.generation_batch_size
    encoded = [ids for ids in (_chat(tokenizer, p.text) for p in prompt_list) if len(ids) <= MAX_PROMPT_TOKENS]
    if len(encoded) < len(prompt_list):
        logger.info("left out %d prompts longer than %d tokens", len(prompt_list) - len(encoded), MAX_PROMPT_TOKENS)
    shards = [work / f"shard-{i:05d}.pt" for i in range(math.ceil(len(encoded) / size))]
    progress = tqdm(total=len(encoded), desc="target responses", unit="conversation")
    for index, shard in enumerate(shards):
        if not shard.exists():
            done = generate(
                worker,
                encoded[index * size : (index + 1) * size],
                config.max_new_tokens,
                stop_ids,
                lambda i: step.RequestSampling(temperature=0.0),
                size,
            )
            dataset.save_shard(shard, done)
            on_shard()
        progress.update(min(size, len(encoded) - index * size))
    progress.close()
    conversations = [c for c in dataset.load_shards(shards) if len(c.token_ids) - c.num_prompt_tokens >= 2]
    if not conversations:
        raise TrainingError("an empty corpus: the target answered no prompt with two tokens or more")
    return conversations
