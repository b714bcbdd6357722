"""OpenVINO GenAI's LLMPipeline on a batch of prompts: run by bench/bench_peers.py with the python of the
OpenVINO environment it makes (this file imports nothing of specdec's).

    VENV/bin/python bench/peer_openvino.py REQUEST.json

REQUEST: {"model": IR directory, "prompts": [...], "max_tokens": N, "prompt_lookup": bool, "batch": B,
"threads": T}. Each prompt is one user message (the model's chat template applied), answered greedily with
exactly N tokens (ignore_eos); B prompts at a time go to one `generate` call. Prints one JSON line: per call,
its seconds, generated tokens and texts.
"""

import json
import sys
import time

import openvino_genai


def main(path: str) -> None:
    request = json.loads(open(path, encoding="utf-8").read())
    options = {"INFERENCE_NUM_THREADS": request["threads"]}
    if request["prompt_lookup"]:
        options["prompt_lookup"] = True
    pipe = openvino_genai.LLMPipeline(request["model"], "CPU", **options)
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = request["max_tokens"]
    config.ignore_eos = True
    config.apply_chat_template = True
    if request["prompt_lookup"]:
        config.num_assistant_tokens = 4
        config.max_ngram_size = 4
    prompts, batch = request["prompts"], request["batch"]
    pipe.generate(prompts[0], config)  # warm-up
    calls = []
    for first in range(0, len(prompts), batch):
        chunk = prompts[first : first + batch]
        start = time.perf_counter()
        result = pipe.generate(chunk, config)  # a list in, DecodedResults out (a str in gives a str)
        seconds = time.perf_counter() - start
        texts = list(result.texts)
        calls.append({"seconds": seconds, "tokens": result.perf_metrics.get_num_generated_tokens(), "texts": texts})
    print(json.dumps(calls))


if __name__ == "__main__":
    main(sys.argv[1])
