"""Where training prompts come from: the openers of the prompts the target writes itself."""

import collections

from draft_training.prompts import SELF_PROMPT_EMPTY_SHARE, SELF_PROMPT_OPENERS, self_prompt_openers


def test_self_written_prompts_mostly_start_with_a_kind_of_task():
    """Left alone the target writes mostly requests for advice: about two in three of its prompts start with
    an opener, spread over the list; the rest start empty; the same seed gives the same starts."""
    openers = self_prompt_openers(3000, seed=0)
    counts = collections.Counter(openers)
    assert abs(counts[""] / len(openers) - SELF_PROMPT_EMPTY_SHARE) < 0.03
    assert set(counts) - {""} == set(SELF_PROMPT_OPENERS)  # every opener is used
    assert max(n for o, n in counts.items() if o) < 3 * len(openers) / len(SELF_PROMPT_OPENERS)
    assert self_prompt_openers(50, seed=0) == openers[:50] and self_prompt_openers(50, seed=1) != openers[:50]
