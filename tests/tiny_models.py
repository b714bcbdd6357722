"""Tiny seeded Llama models for tests: a target and a smaller draft with the same vocabulary."""

from dataclasses import dataclass
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 256


def tiny_llama(seed: int, num_layers: int, hidden: int, heads: int, kv_heads: int) -> LlamaForCausalLM:
    """A randomly initialised Llama with fixed seed (fp32, eval mode)."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init give peaked, input-dependent outputs
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    return model.eval()


@dataclass
class TinyPair:
    target_path: pathlib.Path
    draft_path: pathlib.Path


def make_tiny_pair(directory: pathlib.Path) -> TinyPair:
    """Saves the seeded target (4 layers, GQA) and draft (2 layers) as HF checkpoints."""
    target = tiny_llama(seed=0, num_layers=4, hidden=64, heads=4, kv_heads=2)
    draft = tiny_llama(seed=1, num_layers=2, hidden=32, heads=2, kv_heads=1)
    pair = TinyPair(directory / "target", directory / "draft")
    target.save_pretrained(pair.target_path)
    draft.save_pretrained(pair.draft_path)
    return pair
