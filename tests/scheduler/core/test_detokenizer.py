"""Incremental detokenisation: stable UTF-8 text, stop strings never streamed in part."""

import pytest

from scheduler_service.core.detokenizer import IncrementalDetokenizer


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
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
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


class CharTokenizer:
    """Token i is the character "ab"[i]: a small alphabet makes stop strings overlap a lot."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("ab"[i] for i in ids)


def naive_stream(text: str, stops: list[str]) -> tuple[str, list[str]]:
    """The definition: cut at the earliest stop string; hold back the longest suffix that begins a stop string."""
    deltas, emitted = [], 0
    for end in range(1, len(text) + 1):
        seen = text[:end]
        starts = [i for stop in stops if (i := seen.find(stop)) != -1]
        if starts:
            deltas.append(seen[emitted : min(starts)])
            return seen[: min(starts)], deltas
        held = max((n for stop in stops for n in range(1, len(stop)) if seen.endswith(stop[:n])), default=0)
        deltas.append(seen[emitted : end - held])
        emitted = end - held
    return text, deltas


def test_stop_strings_match_the_definition_on_random_text():
    """The incremental matcher (KMP per stop string) agrees with the brute-force definition, overlaps included."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        detokenizer = IncrementalDetokenizer(CharTokenizer(), prompt_token_ids=[], stop_strings=stops)
        deltas = stream(detokenizer, ["ab".index(c) for c in text])
        want_text, want_deltas = naive_stream(text, stops)
        assert (detokenizer.output_text, deltas) == (want_text, want_deltas), (text, stops)


def test_each_character_is_matched_once_per_stop_string(monkeypatch):
    """16 stop strings of 1,000 characters that keep almost matching: every character is fed once to each
    stop string's automaton (the old hold-back search rescanned ~len(stop)^2 characters per token)."""
    from scheduler_service.core import detokenizer as module

    num_fed = 0
    feed = module.StopStringMatcher.feed

    def counting_feed(self, char):
        nonlocal num_fed
        num_fed += 1
        return feed(self, char)

    monkeypatch.setattr(module.StopStringMatcher, "feed", counting_feed)
    stops = ["a" * 999 + "b"] * 16
    detokenizer = IncrementalDetokenizer(CharTokenizer(), prompt_token_ids=[], stop_strings=stops)
    deltas = stream(detokenizer, [0] * 3000)
    assert deltas[-1] == "a" and detokenizer.next_text_delta() == ""  # 999 "a" held back, one released per token
    assert num_fed == 3000 * 16
