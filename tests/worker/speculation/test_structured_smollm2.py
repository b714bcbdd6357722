"""Structured outputs with the embedded SmolLM2 (slow tier): JSON-schema outputs parse and validate, and
speculation (suffix, eagle3 with its shipped head) changes no token, greedy and seeded."""

import json

import jsonschema
import pytest

from specdec import step, structured
from tests.worker.driver import Driver
from tests.worker.speculation.test_eagle3_smollm2 import BLOCK_SIZE, NUM_BLOCKS, make_worker
from worker_service.runtime.loader import load_tokenizer

pytestmark = pytest.mark.slow
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "year", "genres"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Give me a famous novel as JSON with its name, year and genres.",
    "Describe the film Casablanca as JSON: name, year, genres.",
]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def setup(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    return tokenizer, prompts, structured.to_grammar("json", json.dumps(SCHEMA))


def generate(worker, prompts, grammar, sampling=None, k=0):
    outputs = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS).generate(
        prompts, MAX_TOKENS, sampling=sampling, num_speculative_tokens=k, grammar=grammar
    )
    return [o[: o.index(2)] if 2 in o else o for o in outputs]


@pytest.mark.parametrize("proposer", ["suffix", "eagle3"])
def test_json_outputs_validate_and_speculation_changes_no_token(smollm2_path, setup, proposer):
    tokenizer, prompts, grammar = setup
    plain_worker = make_worker(smollm2_path, "bfloat16", "none")
    seeded = [step.RequestSampling(temperature=0.8, seed=11 + i) for i in range(len(prompts))]
    for sampling in (None, seeded):
        plain = generate(plain_worker, prompts, grammar, sampling)
        for tokens in plain:
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
        assert generate(make_worker(smollm2_path, "bfloat16", proposer), prompts, grammar, sampling, k=4) == plain
