"""The training loop of a head: unrolled steps, a weighted loss, held-out accuracy by position, checkpoints.

The loss of step j is the cross-entropy of the draft vocabulary against the token the target wrote at that
position (its greedy choice: the responses are the target's own), weighted 0.8^j as EAGLE-3 weights its steps.
With a teacher (soft labels, draft_training/teacher.py) each step adds the cross-entropy against the target's
whole distribution there over the draft vocabulary: what the target thought of the other tokens, while the
greedy token keeps its own term (serving drafts the argmax; on a flat distribution the soft term alone barely
moves it: measured on the tiny test target, whose soft-only head never had a draft accepted).
Held-out accuracy at position j is how often step j's argmax is that token, with the earlier tokens right: the
chance that draft j + 1 is accepted given the drafts before it were.

Precision (recipe.PRECISIONS): the weights and the optimizer stay fp32; "bfloat16" runs the head's forward and backward
under bf16 autocast (matmuls in bf16, reductions and the losses in fp32), "auto" does so where the device has
native bf16 matmuls (a CPU with AVX-512 BF16 or AMX, a CUDA GPU that supports it) and stays fp32 elsewhere, where
bf16 would be emulated and slower.
"""

import logging
import math
import pathlib
import random

import torch
from tqdm import tqdm

from draft_training import dataset
from draft_training.head import TrainableHead
from draft_training.teacher import TargetTail

logger = logging.getLogger(__name__)

STEP_WEIGHT = 0.8
WARMUP_FRACTION = 0.05


class Trainer:
    def __init__(
        self,
        head: TrainableHead,
        config,
        checkpoint: pathlib.Path,
        on_checkpoint=lambda: None,
        teacher: TargetTail | None = None,
    ):
        self.head = head
        self.teacher = teacher  # soft labels where given
        self.config = config
        self.checkpoint = checkpoint
        self.on_checkpoint = on_checkpoint  # called after each checkpoint is written
        self.device = head.lm_head.weight.device
        self.autocast_dtype = autocast_dtype(config.precision, self.device)  # None: fp32
        logger.info("training precision: %s", "bfloat16 autocast" if self.autocast_dtype else "float32")
        self.optimizer = torch.optim.AdamW(
            head.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=0.0
        )
        # target id -> draft id, or IGNORE outside the draft vocabulary
        self.target_to_draft = torch.full(
            (head.config["vocab_size"],), dataset.IGNORE, dtype=torch.int64, device=self.device
        )
        self.target_to_draft[head.draft_to_target] = torch.arange(len(head.draft_to_target), device=self.device)

    def fit(self, train: list, held_out: list) -> list[float]:
        """Trains for the configured epochs (resuming a checkpoint); returns held-out accuracy by position."""
        config = self.config
        epochs = [self._epoch_batches(train, epoch) for epoch in range(config.epochs)]
        total = sum(map(len, epochs))
        done = self._resume()
        progress = tqdm(total=total, initial=done, desc="training", unit="batch")
        step = 0
        for batches in epochs:
            for batch in batches:
                if step >= done:
                    self._set_lr(step, total)
                    loss, accuracy = self._train_step(batch)
                    progress.set_postfix(loss=f"{loss:.3f}", acc0=f"{accuracy:.2f}")
                    progress.update()
                    if (step + 1) % config.checkpoint_every == 0 and step + 1 < total:
                        self._save(step + 1)
                        logger.info(
                            "step %d/%d: held-out accuracy by position %s",
                            step + 1,
                            total,
                            _fmt(self.evaluate(held_out)),
                        )
                step += 1
        progress.close()
        self._save(total)
        accuracy = self.evaluate(held_out)
        logger.info("held-out accuracy by position %s", _fmt(accuracy))
        return accuracy

    def _epoch_batches(self, train: list, epoch: int) -> list:
        batches = dataset.batches(train, self.config.batch_tokens)
        random.Random(self.config.seed * 1000 + epoch).shuffle(batches)
        return batches

    def _set_lr(self, step: int, total: int) -> None:
        warmup = max(1, int(WARMUP_FRACTION * total))
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        )
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate * scale

    def _losses(self, batch: list, soft: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(the weighted loss, per step (correct, counted)); soft=False leaves the teacher out (evaluation counts
        only)."""
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            return self._autocast_losses(batch, soft)

    def _autocast_losses(self, batch: list, soft: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        tokens, features, labels = dataset.collate(batch, self.config.num_steps, self.device)
        logits = self.head(tokens, features, self.config.num_steps)
        # row q: the target's log-probabilities of token q + 1, which step j's row q - j - 1 predicts
        teacher = self.teacher.log_probs(features) if self.teacher is not None and soft else None
        loss, weights, counts = 0.0, 0.0, []
        for j, (step_logits, label) in enumerate(zip(logits, labels)):
            draft_label = torch.where(label >= 0, self.target_to_draft[label.clamp(min=0)], dataset.IGNORE)
            if (draft_label >= 0).any():
                step_loss = torch.nn.functional.cross_entropy(
                    step_logits.flatten(0, 1), draft_label.flatten(), ignore_index=dataset.IGNORE
                )
                if teacher is not None:
                    soft = torch.nn.functional.pad(
                        teacher[:, j + 1 :], (0, 0, 0, j + 1), value=float("-inf")
                    ).exp()  # [B, R, draft V]
                    soft_cross_entropy = -(soft * torch.log_softmax(step_logits, dim=-1)).sum(-1)
                    step_loss = step_loss + soft_cross_entropy[label >= 0].mean()
                loss = loss + STEP_WEIGHT**j * step_loss
                weights += STEP_WEIGHT**j
            predicted = self.head.draft_to_target[step_logits.argmax(-1)]
            valid = label >= 0
            counts.append((int((predicted == label)[valid].sum()), int(valid.sum())))
        return loss / max(weights, 1e-9), counts

    def _train_step(self, batch: list) -> tuple[float, float]:
        self.head.train()
        loss, counts = self._losses(batch)
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(loss, torch.Tensor):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
            self.optimizer.step()
        return float(loss.detach() if isinstance(loss, torch.Tensor) else loss), counts[0][0] / max(counts[0][1], 1)

    @torch.no_grad()
    def evaluate(self, held_out: list) -> list[float]:
        """Held-out accuracy by draft position (see the module docstring)."""
        self.head.eval()
        totals = [[0, 0] for _ in range(self.config.num_steps)]
        for batch in dataset.batches(held_out, self.config.batch_tokens):
            for total, (correct, count) in zip(totals, self._losses(batch, soft=False)[1]):
                total[0] += correct
                total[1] += count
        return [round(correct / max(count, 1), 4) for correct, count in totals]

    def _save(self, step: int) -> None:
        partial = self.checkpoint.with_suffix(".partial")
        torch.save({"step": step, "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}, partial)
        partial.replace(self.checkpoint)
        self.on_checkpoint()

    def _resume(self) -> int:
        if not self.checkpoint.exists():
            return 0
        state = torch.load(self.checkpoint, map_location=self.device)
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        logger.info("resuming training at step %d (%s)", state["step"], self.checkpoint)
        return state["step"]


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype training autocasts to on `device` for a recipe.PRECISIONS value; None: fp32 throughout."""
    if precision == "auto":
        precision = "bfloat16" if has_native_bf16(device) else "float32"
    return torch.bfloat16 if precision == "bfloat16" else None


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` runs bf16 matmuls in hardware (oneDNN's check on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return (
        device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _fmt(accuracy: list[float]) -> str:
    return " ".join(f"{j + 1}:{a:.3f}" for j, a in enumerate(accuracy))
