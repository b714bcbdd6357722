"""End to end with the embedded SmolLM2 (`specdec serve` in this process, tests/serving.py): 8 concurrent
streaming requests equal `transformers` generate, served with exact (fp32) activations; with the default int8
ones, speculation's outputs equal plain decoding's."""

import pytest

from specdec.v1 import generation_pb2 as pb
from tests.e2e.client import as_complete, chat_prompts, stream_all
from tests.serving import serve_in_process

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain why the sky is blue in one sentence.",
    "Translate 'good morning' into German.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
]
MAX_TOKENS = 32
# The default model is q4_1 with int8 activations, which round what transformers computes in fp32 (on "What is the
# capital of France?" both they and llama.cpp's Q4_1 answer "L'Étoile, la ..."): servers compared with
# transformers take exact activations.
EXACT = ["--quantized-activations", "fp32"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    return chat_prompts(smollm2_path, QUESTIONS)


@pytest.fixture(scope="module")
def reference(smollm2_greedy, prompts):
    return [smollm2_greedy(p, MAX_TOKENS) for p in prompts]


CONFIGS = {
    "plain-sync": ["--proposer", "none", "--scheduling", "sync"],
    "ngram-async": ["--proposer", "ngram", "--num-speculative-tokens", "4", "--scheduling", "async"],
    "ngram-sync-preempt": [
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "4",
        "--scheduling",
        "sync",
        "--num-kv-blocks",
        "12",
    ],
    # fixed k: under the goodput policy suffix may draft nothing on a loaded machine (tests/e2e/test_serving_tiny.py)
    "suffix-async": [
        "--proposer",
        "suffix",
        "--num-speculative-tokens",
        "8",
        "--scheduling",
        "async",
        "--speculation-policy",
        "fixed",
    ],
    # The head that ships for the default model, found without a path.
    "eagle3-async": ["--proposer", "eagle3", "--scheduling", "async"],
    "eagle3,suffix-sync-preempt": ["--proposer", "eagle3,suffix", "--scheduling", "sync", "--num-kv-blocks", "12"],
}


def greedy_requests(prompts: list[list[int]]) -> list[pb.GenerateRequest]:
    """One greedy request of MAX_TOKENS per prompt (token ids)."""
    sampling = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [pb.GenerateRequest(prompt_token_ids=p, sampling=sampling) for p in prompts]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_chat_requests_match_transformers(smollm2_path, prompts, reference, name):
    with serve_in_process(
        ["--model", str(smollm2_path), "--kv-cache-memory-gib", "0.5", *EXACT, *CONFIGS[name]]
    ) as server:
        results = stream_all(server.stub, greedy_requests(prompts))
        info = server.wait_idle()
    assert [tokens for tokens, _ in results] == reference  # HF stops at EOS, and so does the server
    assert info.num_free_kv_blocks == info.num_kv_blocks
    if "preempt" in name:
        assert info.counters.num_preemptions > 0
    if not name.startswith("plain"):
        assert info.counters.num_accepted_tokens > 0


def test_the_default_int8_activations_speculate_losslessly(smollm2_path, prompts):
    """The default configuration (q4_1, int8 activations, suffix under the goodput policy) against the same
    server's plain decoding: the same greedy tokens for 8 concurrent requests."""
    outputs = {}
    for name, flags in (("plain", ["--proposer", "none"]), ("suffix", CONFIGS["suffix-async"])):
        with serve_in_process(["--model", str(smollm2_path), "--kv-cache-memory-gib", "0.5", *flags]) as server:
            outputs[name] = [tokens for tokens, _ in stream_all(server.stub, greedy_requests(prompts))]
            info = server.wait_idle()
    assert outputs["suffix"] == outputs["plain"]
    assert info.counters.num_accepted_tokens > 0


def test_chat_messages_and_text(smollm2_path):
    with serve_in_process(["--model", str(smollm2_path), "--kv-cache-memory-gib", "0.25", *EXACT]) as server:
        chat = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
            sampling=pb.SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]),
        )
        done = server.stub.Complete(as_complete(chat))
    assert done.finish_reason == pb.FINISH_REASON_STOP
    assert done.text.startswith("The capital of France is") and "Paris" not in done.text


@pytest.mark.parametrize("name", ["plain-sync", "ngram-async", "suffix-async"])
def test_a_second_turn_reuses_the_first_and_still_matches_transformers(smollm2_path, smollm2_greedy, name):
    """Turn 2 sent with turn 1's answer in the history finds turn 1's prompt and answer in the prefix cache;
    its greedy output is still `transformers`' own."""
    from worker_service.runtime.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    turns = [("List three prime numbers.", "Now add them up."), ("What is the capital of France?", "And of Italy?")]
    with serve_in_process(
        ["--model", str(smollm2_path), "--kv-cache-memory-gib", "0.5", *EXACT, *CONFIGS[name]]
    ) as server:
        for first, second in turns:
            turn1 = chat_prompts(smollm2_path, [first])[0]
            answer, _ = stream_all(
                server.stub,
                [
                    pb.GenerateRequest(
                        prompt_token_ids=turn1, sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
                    )
                ],
            )[0]
            history = [
                {"role": "user", "content": first},
                {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": second},
            ]
            turn2 = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            tokens, last = stream_all(
                server.stub,
                [
                    pb.GenerateRequest(
                        prompt_token_ids=turn2, sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
                    )
                ],
            )[0]
            assert tokens == smollm2_greedy(turn2, MAX_TOKENS)
            assert last.usage.cached_prompt_tokens >= len(turn1) // 16 * 16 > 0
        info = server.wait_idle()
    assert info.counters.prefix_cache_hits > 0 and info.num_free_kv_blocks == info.num_kv_blocks
