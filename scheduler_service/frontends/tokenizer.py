"""The scheduler's tokenizer: `tokenizers` + the model's Jinja chat template, no torch.

Reads a Hugging Face checkpoint directory: `tokenizer.json`, and the chat
template from `chat_template.jinja` or `tokenizer_config.json` (or a file
given instead: --chat-template).
"""

import json
import pathlib

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer, or a prompt cannot be rendered."""


def _raise(message: str):
    raise TokenizerError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as `transformers`' templates get it (jinja2's own tojson escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTokenizer:
    """Encode, decode and render chat messages the way `transformers` does."""

    def __init__(self, model_dir: str | pathlib.Path, chat_template: str | pathlib.Path | None = None):
        model_dir = pathlib.Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = config.get("bos_token") or ""
        self.eos_token = config.get("eos_token") or ""
        template_path = model_dir / "chat_template.jinja"
        if chat_template is not None:
            try:
                template = pathlib.Path(chat_template).read_text()
            except OSError as exc:
                raise TokenizerError(f"cannot read the chat template {chat_template}: {exc.strerror}") from exc
        else:
            template = template_path.read_text() if template_path.exists() else config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.chat_template = env.from_string(template) if isinstance(template, str) else None

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (what the structured-output compiler reads)."""
        return self.tokenizer.to_str()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, without special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Renders messages (and the tools offered, OpenAI's shape, as `transformers` passes them) with the
        generation prompt appended, then tokenises the text."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template: send a text prompt or token ids")
        try:
            text = self.chat_template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TokenizerError:
            raise
        except Exception as exc:  # a template that cannot render these messages (jinja2's errors)
            raise TokenizerError(f"the chat template cannot render these messages: {exc}") from exc
        return self.encode(text)
