"""Structured outputs: a client's constraint as the grammar llguidance compiles, and the tokenizer it masks with.

The one place that knows the kinds of constraint (`CONSTRAINT_KINDS`, the fields of the proto's
`StructuredOutputs`) and how each becomes a grammar. The scheduler compiles a request's constraint with it
before the request is queued (scheduler_service/frontends/structured.py); the worker builds a matcher from
the same grammar text and masks every sampled position (worker_service/speculation/structured.py).

JSON is generated compactly, as `json.dumps` writes it (", " and ": ", no other whitespace): a small model
given free whitespace can pad forever, and every separator the grammar fixes is a token drafted for free.
"""

import json

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
FORCED_PROPOSER = "forced"  # the proposer name of drafts a constraint forces (the worker's step outputs say it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names the problem (INVALID_ARGUMENT)."""


def to_grammar(kind: str, value) -> str:
    """The llguidance grammar (LLMatcher's input) of one constraint: a JSON schema's text, True for any JSON
    object, a regular expression, a list of choices, or a Lark (or GBNF) grammar."""
    if kind == "json":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
        if schema is False:
            raise ConstraintError("the JSON schema is false: it allows no value")
        if schema is True:
            schema = {}  # any JSON value
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = list(value)
        if not choices or any(not c for c in choices):
            raise ConstraintError("choice needs at least one choice, and no empty one")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        if not value.strip():
            raise ConstraintError("the grammar is empty")
        return LLMatcher.grammar_from_lark(gbnf_to_lark(value) if "::=" in value else value)
    raise ConstraintError(f"unknown constraint {kind!r}; choose from {', '.join(CONSTRAINT_KINDS)}")


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's view of the model's tokenizer (`tokenizer.json`'s text); masks have `vocab_size` entries
    (the model's output size, which may exceed the tokenizer's). Costs ~0.3 s: build it once."""
    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def compile_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A matcher at the start of `grammar`; raises ConstraintError with llguidance's message (an invalid
    regex, an unsupported schema keyword, a grammar over llguidance's size limits)."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"invalid constraint: {matcher.get_error().strip()}")
    return matcher
