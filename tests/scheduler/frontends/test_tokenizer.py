"""The torch-free scheduler tokenizer agrees with `transformers`."""

import subprocess
import sys

import pytest

from scheduler_service.frontends.tokenizer import ChatTokenizer, TokenizerError


@pytest.mark.slow
def test_matches_transformers_on_smollm2(smollm2_path):
    from transformers import AutoTokenizer

    ours, theirs = ChatTokenizer(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcödé 🙂"}],
    ):
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        assert ours.apply_chat_template(messages) == want
    ids = ours.encode("Hello, world! ünïcödé")
    assert ids == theirs.encode("Hello, world! ünïcödé", add_special_tokens=False)
    assert ours.decode(ids) == "Hello, world! ünïcödé"


def test_no_torch_import(smollm2_path):
    code = (
        f"import sys; from scheduler_service.frontends.tokenizer import ChatTokenizer; "
        f"t = ChatTokenizer({str(smollm2_path)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        ChatTokenizer(tmp_path)
