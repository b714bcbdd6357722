"""Speculation policy: how many lookahead slots a step gets, and each request's k cap."""

from scheduler_service.request import Request


class SpeculationPolicy:
    """Decides the speculation length per step and per request.

    Auto-disable: when more than `speculative_disable_queue_size` requests run,
    a step gets no lookahead slots (k = 0, no proposer), because at high batch
    sizes verifying drafts costs more than it saves. It is decided per step, so
    speculation resumes once the load falls.
    """

    def __init__(self, num_speculative_tokens: int, speculative_disable_queue_size: int | None) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_disable_queue_size = speculative_disable_queue_size

    def is_disabled_for_step(self, num_running: int) -> bool:
        """Whether the running-queue size switches speculation off for a step."""
        limit = self.speculative_disable_queue_size
        return limit is not None and num_running > limit

    def num_lookahead_slots_for_step(self, num_running: int) -> int:
        """The step's k: the server's k, or 0 when auto-disabled."""
        return 0 if self.is_disabled_for_step(num_running) else self.num_speculative_tokens

    def num_speculative_tokens_for(self, request: Request, max_model_len: int) -> int:
        """The request's k cap: min(server k, its override), or 0 when it opted out.

        Lowered near the end, as drafts past max_tokens or max_model_len would be
        wasted work and KV slots.
        """
        if not request.is_speculation_enabled:
            return 0
        k = self.num_speculative_tokens
        if request.num_speculative_tokens is not None:
            k = min(k, request.num_speculative_tokens)
        return min(k, max(request.num_tokens_left(max_model_len) - 1, 0))

    def speculation_for(self, request: Request, num_new_tokens: int, num_budget_tokens_left: int,
                        num_lookahead_slots: int, max_model_len: int) -> tuple[int, int]:
        """(lookahead slots to reserve, k cap for the worker) of a request in a step with k = num_lookahead_slots.

        Only a decode (exactly one pending token) speculates. Its lookahead slots
        count against the step's token budget, of which `num_budget_tokens_left`
        remain after its new tokens.
        """
        k_cap = self.num_speculative_tokens_for(request, max_model_len)
        if not num_new_tokens == request.num_pending_tokens == 1:
            return 0, k_cap
        k_cap = min(k_cap, num_budget_tokens_left)
        return min(num_lookahead_slots, k_cap), k_cap
