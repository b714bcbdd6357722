"""Tiny seeded Llama models for tests: a target and a smaller draft with the same vocabulary."""

from dataclasses import dataclass
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 256


def tiny_llama(
    seed: int,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab_size: int = VOCAB_SIZE,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with fixed seed (fp32, eval mode)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
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
    eagle3_head_path: pathlib.Path | None = None  # a random EAGLE-3 head for the target, where one was saved


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
        "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    )


def make_tiny_pair(directory: pathlib.Path) -> TinyPair:
    """Saves the seeded target (4 layers, GQA) and draft (2 layers) as HF checkpoints."""
    target = tiny_llama(seed=0, num_layers=4, hidden=64, heads=4, kv_heads=2)
    draft = tiny_llama(seed=1, num_layers=2, hidden=32, heads=2, kv_heads=1)
    pair = TinyPair(directory / "target", directory / "draft")
    target.save_pretrained(pair.target_path)
    draft.save_pretrained(pair.draft_path)
    save_tiny_tokenizer(pair.target_path)
    return pair


# A byte-level BPE that can spell any text (JSON included): 3 special tokens, the 256 bytes, and merges of
# JSON's frequent pairs, so that the grammar's forced text spans multi-byte tokens.
JSON_MERGES = [
    ("{", '"'),
    ('"', ":"),
    (":", "Ġ"),
    (",", "Ġ"),
    ("Ġ", '"'),
    ('"', "}"),
    ('"', ","),
    ("t", "r"),
    ("tr", "u"),
    ("tru", "e"),
    ("n", "u"),
    ("nu", "l"),
    ("nul", "l"),
    ("[", '"'),
    ('"', "]"),
]
BYTE_VOCAB_SIZE = 3 + 256 + len(JSON_MERGES)  # the byte-level tokenizer's: specials, bytes, merges


def save_tiny_byte_tokenizer(directory: pathlib.Path) -> int:
    """Saves the byte-level tokenizer (0 unk, 1 bos, 2 eos); returns its vocabulary size."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(byte_chars, key=lambda c: ord(c)):
        vocab[char] = len(vocab)
    for a, b in JSON_MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) == BYTE_VOCAB_SIZE
    tokenizer = Tokenizer(models.BPE(vocab, JSON_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}"
    )
    return len(vocab)


def make_tiny_byte_pair(directory: pathlib.Path, max_positions: int = 512) -> TinyPair:
    """A seeded target and draft over the byte-level vocabulary (for structured outputs), and a random EAGLE-3
    head for the target."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = TinyPair(directory / "target", directory / "draft", directory / "head")
    for path in (pair.target_path, pair.draft_path):
        path.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tiny_byte_tokenizer(pair.target_path)
    for path, seed, shape in ((pair.target_path, 0, (4, 64, 4, 2)), (pair.draft_path, 1, (2, 32, 2, 1))):
        tiny_llama(seed, *shape, vocab_size=vocab_size, max_positions=max_positions).save_pretrained(path)
    save_tiny_eagle3_head(pair.eagle3_head_path, vocab_size=vocab_size)
    return pair


def save_tiny_eagle3_head(
    directory: pathlib.Path,
    target_hidden: int = 64,
    vocab_size: int = VOCAB_SIZE,
    draft_vocab_size: int = 200,
    naming: str = "specforge",
    seed: int = 7,
    drop: str | None = None,
    aux_layers: list[int] | None = None,
    d2t: list[int] | None = None,
) -> pathlib.Path:
    """A randomly initialised EAGLE-3 head for the tiny target, in SpecForge's (`midlayer.`) or vLLM
    speculators' (`model.layers.0.`) naming; `drop` leaves one tensor out. Draft id i is target id i + 3,
    or i + d2t[i]."""
    from safetensors.torch import save_file

    hidden, heads, kv_heads = 64, 4, 2
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.15

    layer = {
        "input_layernorm.weight": torch.ones(hidden),
        "hidden_norm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "mlp.gate_proj.weight": weight(2 * hidden, hidden),
        "mlp.up_proj.weight": weight(2 * hidden, hidden),
        "mlp.down_proj.weight": weight(hidden, 2 * hidden),
    }
    prefix = "midlayer." if naming == "specforge" else "model.layers.0."
    tensors = {prefix + name: t for name, t in layer.items()}
    tensors.update(
        {
            "fc.weight": weight(hidden, 3 * target_hidden),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": weight(draft_vocab_size, hidden),
            "d2t": torch.tensor(d2t or [3] * draft_vocab_size, dtype=torch.int64),
            "t2d": torch.tensor([3 <= i < 3 + draft_vocab_size for i in range(vocab_size)]),
        }
    )
    if drop is not None:
        del tensors[drop]
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "target_hidden_size": target_hidden,
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
