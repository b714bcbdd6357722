"""Incremental detokenisation: stable UTF-8 text, stop strings never streamed in part."""

import pytest

from scheduler_service.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token i is the byte string PIECES[i]; some pieces are halves of a UTF-8 character."""

    PIECES = [b"Hel", b"lo", b" wo", b"rld", b"!", b"\xc3", b"\xa9", b" ", b"ab", b"c", b"x", b"<eos>"]
    SPECIAL_IDS = {11}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self.SPECIAL_IDS)]
        return b"".join(self.PIECES[i] for i in kept).decode("utf-8", errors="replace")


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = []
    for token_id in token_ids:
        detokenizer.add_token(token_id)
        deltas.append(detokenizer.next_text_delta())
        if detokenizer.is_stopped:
            break
    return deltas


def test_multi_byte_character_waits_for_its_last_byte():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), prompt_token_ids=[0])
    assert stream(detokenizer, [7, 5, 6, 4]) == [" ", "", "é", "!"]
    assert detokenizer.output_text == " é!"


def test_stop_string_is_held_back_and_cut():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [7], stop_strings=["world"])
    deltas = stream(detokenizer, [0, 1, 2, 3, 4])
    assert deltas == ["Hel", "lo", " ", ""]  # " wo" could start "world": "wo" waits
    assert detokenizer.is_stopped and detokenizer.output_text == "Hello "
    assert detokenizer.next_text_delta(is_finished=True) == ""


def test_false_start_of_a_stop_string_is_released():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [7], stop_strings=["abc!"])
    assert stream(detokenizer, [8, 9, 10]) == ["", "", "abcx"]
    assert not detokenizer.is_stopped


def test_held_back_text_is_flushed_at_finish():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [7], stop_strings=["abc!"])
    assert stream(detokenizer, [8, 9]) == ["", ""]
    assert detokenizer.next_text_delta(is_finished=True) == "abc"


def test_earliest_of_several_stop_strings_wins_and_specials_are_skipped():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [7], stop_strings=["rld", "lo w"])
    assert "".join(stream(detokenizer, [11, 0, 1, 2, 3])) == "Hel"
    assert detokenizer.output_text == "Hel"


def test_incomplete_character_at_finish_is_flushed_as_replacement():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [7])
    assert stream(detokenizer, [4, 5]) == ["!", ""]
    assert detokenizer.next_text_delta(is_finished=True) == "\ufffd"


def test_hugging_face_byte_level_bpe_round_trips():
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world", "naïve café déjà vu"] * 5, trainer=trainer)
    text = "café 日本 hello naïve 🙂 world"  # 日, 本 and 🙂 were never merged: one token per byte
    token_ids = tokenizer.encode(text).ids
    assert "\ufffd" in tokenizer.decode(token_ids[:4])
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop_strings=["vu"])
    deltas = stream(detokenizer, token_ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + detokenizer.next_text_delta(is_finished=True) == text


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(ByteTokenizer(), [], stop_strings=[""])
