"""Incremental detokenisation with stop strings.

Text is streamed only once it is stable: a token sequence that ends inside a
multi-byte UTF-8 character decodes to a trailing U+FFFD, so those tokens wait
for the rest of the character. Text that could be the beginning of a stop
string is held back, so a client never sees part of a stop string.

Stop strings are matched incrementally (one Knuth-Morris-Pratt automaton per
stop string, fed each new character once): the work per token is linear in
the new text times the number of stop strings, never in the output length or
a stop string's length squared.
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


class StopStringMatcher:
    """Knuth-Morris-Pratt over a stream of characters for one stop string.

    Invariant: `state` is the length of the longest prefix of the stop string
    that is a suffix of the characters fed so far (shorter than the string).
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # failure[i]: the longest proper prefix of stop[:i + 1] that is also its suffix.
        self._failure = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._failure[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._failure[i] = k

    def feed(self, char: str) -> bool:
        """Advances by one character; True when it completes the stop string."""
        k, stop = self.state, self.stop
        while k and stop[k] != char:
            k = self._failure[k - 1]
        if stop[k] == char:
            k += 1
        if k == len(stop):
            self.state = self._failure[k - 1]
            return True
        self.state = k
        return False


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, cutting at the first stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop_strings: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._matchers = [StopStringMatcher(s) for s in stop_strings]
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

    def add_token(self, token_id: int, can_stop: bool = True) -> bool:
        """Appends one output token; returns True when it completes a stop string (never while not `can_stop`:
        text before min_tokens is out is not searched for stop strings)."""
        assert not self.is_stopped, "no tokens may follow a completed stop string"
        self._token_ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._advance(new_text[len(prefix_text) :], can_stop)
        return self.is_stopped

    def next_text_delta(self, is_finished: bool = False) -> str:
        """Text not yet returned that is safe to stream; everything left when `is_finished`."""
        if is_finished and not self.is_stopped and self._read_offset < len(self._token_ids):
            prefix_text, new_text = self._decode_window()  # flush an incomplete character as it is
            self._advance(new_text[len(prefix_text) :])
        end = len(self._text)
        if not (is_finished or self.is_stopped):
            end -= self._num_chars_held_back()
        # Invariant: held-back text never reaches into emitted text (a stop string
        # starting there would have made a longer held-back suffix earlier).
        assert end >= self._num_chars_emitted
        delta = self._text[self._num_chars_emitted : end]
        self._num_chars_emitted = end
        return delta

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_ids = self._token_ids[self._prefix_offset : self._read_offset]
        prefix_text = decode(prefix_ids, skip_special_tokens=self._skip_special_tokens)
        new_text = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=self._skip_special_tokens)
        return prefix_text, new_text

    def _advance(self, delta: str, can_stop: bool = True) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        start = len(self._text)
        self._text += delta
        # A stop string may begin in earlier text and end in this delta; the earliest start wins.
        stop_starts = [
            start + offset + 1 - len(m.stop)
            for offset, char in enumerate(delta)
            for m in self._matchers
            if m.feed(char)
        ]
        if stop_starts and can_stop:
            self._text = self._text[: min(stop_starts)]
            self.is_stopped = True

    def _num_chars_held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        return max((m.state for m in self._matchers), default=0)
