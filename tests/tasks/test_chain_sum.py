"""The running-sum task of the real-model GRPO ablation: problems, splits, grading."""

import pytest

from quads.tasks.chain_sum import (
    NUM_NUMBERS,
    is_heldout,
    make_problems,
    reward_chain_sum,
    score_completion,
    worked_solution,
)


def test_problems_are_deterministic_and_splits_disjoint():
    train = make_problems(200, seed=3)
    assert train == make_problems(200, seed=3) and train != make_problems(200, seed=4)
    held = make_problems(50, seed=3, split="heldout")
    assert all(not is_heldout(p["numbers"]) for p in train) and all(is_heldout(p["numbers"]) for p in held)
    assert all(len(p["numbers"]) == NUM_NUMBERS and p["answer"] == str(sum(p["numbers"])) for p in held)
    with pytest.raises(ValueError, match="split"):
        make_problems(1, split="test")


def test_grading_gives_full_partial_and_no_credit():
    numbers = [7, 3, 9, 4]
    assert worked_solution(numbers) == (
        "Step 1: 7 + 3 = 10. The running total is now 10.\n"
        "Step 2: 10 + 9 = 19. The running total is now 19.\n"
        "Step 3: 19 + 4 = 23. The running total is now 23.\nAnswer: 23")
    assert score_completion(worked_solution(numbers), numbers) == {"final": 1.0, "steps": 1.0, "reward": 1.0}
    slip = worked_solution(numbers).replace("= 19. The running total is now 19", "= 18. The running total is now 18")
    slip = slip.replace("Answer: 23", "Answer: 22")  # one slip: it and later steps do not count
    assert score_completion(slip, numbers) == {"final": 0.0, "steps": pytest.approx(1 / 3), "reward": pytest.approx(1 / 6)}
    lucky = "Answer: 23"  # right total without the worked steps: final credit only
    assert score_completion(lucky, numbers)["reward"] == 0.5
    assert score_completion("I cannot do this.", numbers)["reward"] == 0.0
    conversational = [[{"role": "assistant", "content": worked_solution(numbers)}]]
    assert reward_chain_sum(conversational, [numbers]) == [1.0]
