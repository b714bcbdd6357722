"""Incremental detokenisation with stop strings.

Text is streamed only once it is stable: a token sequence that ends inside a
multi-byte UTF-8 character decodes to a trailing U+FFFD, so those tokens wait
for the rest of the character. Text that could be the beginning of a stop
string is held back, so a client never sees part of a stop string.
"""

from typing import Protocol, Sequence

# Prompt tokens decoded along with the output: tokenizers that drop a leading
# space at the start of a sequence (SentencePiece) then render it correctly.
NUM_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What the detokenizer needs from a tokenizer (Hugging Face tokenizers have it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; an incomplete UTF-8 character at the end decodes to U+FFFD."""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, cutting at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop_strings: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop_strings = tuple(stop_strings)
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        self._skip_special_tokens = skip_special_tokens
        # Invariant: token_ids[prefix_offset:read_offset] decodes to text already
        # appended; token_ids[read_offset:] is not decoded into text yet.
        self._token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""
        self._num_chars_emitted = 0
        self.is_stopped = False

    @property
    def output_text(self) -> str:
        """The output text so far (up to, excluding, a completed stop string)."""
        return self._text

    def add_token(self, token_id: int) -> bool:
        """Appends one output token; returns True when it completes a stop string."""
        assert not self.is_stopped, "no tokens may follow a completed stop string"
        self._token_ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._advance(new_text[len(prefix_text):])
        return self.is_stopped

    def next_text_delta(self, is_finished: bool = False) -> str:
        """Text not yet returned that is safe to stream; everything left when `is_finished`."""
        if is_finished and not self.is_stopped and self._read_offset < len(self._token_ids):
            prefix_text, new_text = self._decode_window()  # flush an incomplete character as it is
            self._advance(new_text[len(prefix_text):])
        end = len(self._text)
        if not (is_finished or self.is_stopped):
            end -= self._num_chars_held_back()
        # Invariant: held-back text never reaches into emitted text (a stop string
        # starting there would have made a longer held-back suffix earlier).
        assert end >= self._num_chars_emitted
        delta = self._text[self._num_chars_emitted:end]
        self._num_chars_emitted = end
        return delta

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_ids = self._token_ids[self._prefix_offset:self._read_offset]
        prefix_text = decode(prefix_ids, skip_special_tokens=self._skip_special_tokens)
        new_text = decode(self._token_ids[self._prefix_offset:], skip_special_tokens=self._skip_special_tokens)
        return prefix_text, new_text

    def _advance(self, delta: str) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        # A stop string may begin in earlier text and end in this delta.
        search_start = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += delta
        stop_index = self._find_stop_string(search_start)
        if stop_index is not None:
            self._text = self._text[:stop_index]
            self.is_stopped = True

    def _find_stop_string(self, start: int) -> int | None:
        indices = [i for s in self._stop_strings if (i := self._text.find(s, start)) != -1]
        return min(indices, default=None)

    def _num_chars_held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
