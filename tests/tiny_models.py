"""Tiny seeded Llama models for tests: a target and a smaller draft with the same vocabulary."""

from dataclasses import dataclass
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


def save_tiny_tokenizer(directory: pathlib.Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: id i is the word "w<i>" (0 unk, 1 bos, 2 eos)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}")


def make_tiny_pair(directory: pathlib.Path) -> TinyPair:
    """Saves the seeded target (4 layers, GQA) and draft (2 layers) as HF checkpoints."""
    target = tiny_llama(seed=0, num_layers=4, hidden=64, heads=4, kv_heads=2)
    draft = tiny_llama(seed=1, num_layers=2, hidden=32, heads=2, kv_heads=1)
    pair = TinyPair(directory / "target", directory / "draft")
    target.save_pretrained(pair.target_path)
    draft.save_pretrained(pair.draft_path)
    save_tiny_tokenizer(pair.target_path)
    return pair
