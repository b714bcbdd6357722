"""A minimal in-test scheduler for driving a worker: generous block tables, all prompts at once."""

import itertools

from specdec import step


class Driver:
    """Feeds whole prompts, then decodes every request to `max_tokens` emitted tokens."""

    def __init__(self, execute, block_size: int, num_blocks: int):
        self.execute = execute  # StepRequest -> StepResult (in-process worker or gRPC client)
        self.block_size = block_size
        self.free_blocks = list(reversed(range(num_blocks)))
        self.step_ids = itertools.count()
        self.results: list[step.StepResult] = []

    def blocks(self, num_tokens: int) -> list[int]:
        return [self.free_blocks.pop() for _ in range(-(-num_tokens // self.block_size))]

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: step.RequestSampling | list[step.RequestSampling] | None = None,
        num_speculative_tokens: int | list[int] = 0,
        prefix: str = "r",
        keep: bool = False,
        grammar: str = "",
        tree_widths: list[int] | None = None,
    ) -> list[list[int]]:
        """`sampling`: one for all requests, or one per prompt (default greedy); every decode step has
        k = num_speculative_tokens, one for all or one per prompt (the tables always have room for it).
        `keep`: the worker keeps the requests at the end (ids `{prefix}{i}`), else they are finished.
        `grammar`: every request's structured-output constraint (specdec.structured.to_grammar).
        `tree_widths`: each request's draft_tree_width in every step (default 0: the worker's own)."""
        sampling = sampling or step.RequestSampling(temperature=0.0)
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ks = (
            num_speculative_tokens
            if isinstance(num_speculative_tokens, list)
            else [num_speculative_tokens] * len(prompts)
        )
        ids = [f"{prefix}{i}" for i in range(len(prompts))]
        k_of = dict(zip(ids, ks))
        width_of = dict(zip(ids, tree_widths or [0] * len(prompts)))
        outputs = {rid: [] for rid in ids}
        new = [
            step.NewRequest(
                rid,
                p,
                len(p),
                s,
                self.blocks(len(p) + max_tokens + 8),
                len(p),
                k_of[rid],
                grammar=grammar,
                draft_tree_width=width_of[rid],
            )
            for rid, p, s in zip(ids, prompts, samplings)
        ]
        request = step.StepRequest(next(self.step_ids), new_requests=new)
        while True:
            result = self.execute(request)
            self.results.append(result)
            for out in result.outputs:
                outputs[out.request_id].extend(out.token_ids)
            running = [rid for rid in ids if len(outputs[rid]) < max_tokens]
            if not running:
                break
            cached = [step.CachedRequest(rid, [], -1, 1, k_of[rid], draft_tree_width=width_of[rid]) for rid in running]
            request = step.StepRequest(next(self.step_ids), cached_requests=cached)
            for c in cached:  # keep the whole table: num_blocks_kept = its current length
                c.num_blocks_kept = -(-(len(prompts[ids.index(c.request_id)]) + max_tokens + 8) // self.block_size)
        if not keep:
            self.execute(step.StepRequest(next(self.step_ids), finished_request_ids=ids))
        return [outputs[rid][:max_tokens] for rid in ids]
