"""A grader for the critic-pretraining test (loaded with reward.plugins): the ground truth is
the reward itself ("1" or "-1"), decided by the prompt alone, so a critic that learns to read
the prompt explains the returns; one that does not learn stays near zero."""

from vapo_megatron.rewards import GradeResult
from vapo_megatron.rewards.registry import register_grader


def label(response: str, ground_truth: str) -> GradeResult:
    del response
    correct = ground_truth.strip() == "1"
    return GradeResult(score=1.0 if correct else -1.0, acc=1.0 if correct else 0.0)


register_grader("label", label, replace=True)


def coin(response: str, ground_truth: str) -> GradeResult:
    """Correct when the response has an even number of characters: rewards vary within every
    group, so dynamic sampling keeps groups and every preset has something to learn from."""
    del ground_truth
    correct = len(response) % 2 == 0
    return GradeResult(score=1.0 if correct else -1.0, acc=1.0 if correct else 0.0)


register_grader("coin", coin, replace=True)
