"""Soft labels: the target's tail recomputes the target's own next-token distribution from the stored features,
and the trainer scores each unrolled step against the distribution of the token that step predicts."""

from types import SimpleNamespace

import torch

from draft_training import dataset
from draft_training.generation import Conversation
from draft_training.head import TrainableHead, head_config
from draft_training.teacher import TargetTail
from draft_training.trainer import Trainer
from worker_service.runtime.eagle3_head import default_aux_layers
from worker_service.runtime.loader import load_model

NUM_STEPS = 3


def conversations(model, lengths=(9, 14, 6)) -> list[Conversation]:
    """Random token sequences with their features as the shards store them (bf16), from a full forward."""
    aux_layers = default_aux_layers(model.config.num_hidden_layers)
    out = []
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        tokens = torch.randint(3, model.config.vocab_size, (length,), generator=generator)
        with torch.inference_mode():
            hidden = model(tokens[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i][0, :-1] for i in aux_layers], dim=-1).to(torch.bfloat16)
        out.append(Conversation(tokens.tolist(), 2, features))
    return out


def test_the_tail_gives_the_targets_distribution_over_the_draft_vocabulary(tiny_pair):
    model = load_model(tiny_pair.target_path)
    aux_layers = default_aux_layers(model.config.num_hidden_layers)
    draft_to_target = torch.arange(3, 203)
    tail = TargetTail(model, aux_layers, model.lm_head.weight, draft_to_target)
    batch = conversations(model)
    tokens, features, _ = dataset.collate(batch, NUM_STEPS, torch.device("cpu"))
    got = tail.log_probs(features)  # [B, L - 1, draft V]
    for b, conversation in enumerate(batch):
        with torch.inference_mode():
            logits = model(torch.tensor([conversation.token_ids])).logits[0, :-1]
        expected = torch.log_softmax(logits[:, draft_to_target], dim=-1)
        rows = len(conversation.token_ids) - 1  # rows past the end read padding
        torch.testing.assert_close(got[b, :rows], expected, rtol=0, atol=0.05)  # the features are bf16


class _OneHotTeacher:
    """The target's token as a distribution: row q all on token q + 1."""

    def __init__(self, tokens: torch.Tensor, target_to_draft: torch.Tensor, draft_vocab: int):
        self.tokens, self.target_to_draft, self.draft_vocab = tokens, target_to_draft, draft_vocab

    def log_probs(self, features: torch.Tensor) -> torch.Tensor:
        nxt = self.target_to_draft[self.tokens[:, 1:]]
        return torch.log(torch.nn.functional.one_hot(nxt, self.draft_vocab).float())


def test_a_soft_label_loss_scores_each_step_against_the_token_it_predicts(tiny_pair, tmp_path):
    """With the target's token as its distribution, the soft term is the hard one (the loss doubles): so step j,
    row p is scored against the distribution of token p + j + 2 (mutation check: an off-by-one in the teacher's
    rows fails)."""
    model = load_model(tiny_pair.target_path)
    vocab = model.config.vocab_size
    draft_to_target = torch.arange(vocab)  # every label in the draft vocabulary: the two losses count the same rows
    config = SimpleNamespace(
        learning_rate=1e-3, num_steps=NUM_STEPS, seed=0, epochs=1, checkpoint_every=100, precision="float32"
    )
    torch.manual_seed(0)
    head = TrainableHead(
        head_config(model.config, vocab, default_aux_layers(model.config.num_hidden_layers)),
        model.model.embed_tokens.weight,
        model.lm_head.weight,
        model.model.norm.weight,
        draft_to_target,
    )
    batch = conversations(model)
    hard = Trainer(head, config, tmp_path / "hard.pt")
    tokens, _, _ = dataset.collate(batch, NUM_STEPS, torch.device("cpu"))
    soft = Trainer(head, config, tmp_path / "soft.pt", teacher=_OneHotTeacher(tokens, hard.target_to_draft, vocab))
    with torch.no_grad():
        hard_loss, hard_counts = hard._losses(batch)
        soft_loss, soft_counts = soft._losses(batch)
    torch.testing.assert_close(soft_loss, 2 * hard_loss, rtol=1e-5, atol=1e-5)
    assert soft_counts == hard_counts
