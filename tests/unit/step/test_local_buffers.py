"""The rollout's local buffers (``step/rollout.py``): the engine's arrays, lists and arrays of
another type give the same buffers; a log-prob count unlike the response's is refused."""

from array import array
from types import SimpleNamespace

import pytest
import torch

from vapo_megatron.step.rollout import _local_buffers

PROMPTS = [
    SimpleNamespace(token_ids=[3, 4, 5], record=SimpleNamespace(index=10)),
    SimpleNamespace(token_ids=[6, 7], record=SimpleNamespace(index=11)),
]
RESPONSES = [[8, 9], [], [10, 11, 12]]  # the second one empty
GROUPS = [0, 0, 1]


def outputs(ids_of, logprobs_of):
    return [
        SimpleNamespace(
            prompt_index=g, response_token_ids=ids_of(r),
            logprobs=logprobs_of([-0.25 * (k + 1) for k in range(len(r))]),
            finish_reason="stop",
        )
        for g, r in zip(GROUPS, RESPONSES, strict=True)
    ]  # fmt: skip


def results():
    return [SimpleNamespace(score=1.0, acc=1.0) for _ in RESPONSES]


def buffers(outs):
    return _local_buffers(outs, results(), PROMPTS, range(len(PROMPTS)))


def test_arrays_lists_and_other_types_give_the_same_buffers():
    expected = [
        torch.tensor([3, 4, 5, 3, 4, 5, 6, 7], dtype=torch.int32),
        torch.tensor([8, 9, 10, 11, 12], dtype=torch.int32),
        torch.tensor([-0.25, -0.5, -0.25, -0.5, -0.75]),
    ]
    engine = buffers(outputs(lambda r: array("i", r), lambda v: array("f", v)))
    lists = buffers(outputs(list, list))
    # an array of another type is converted by value, never reinterpreted bit for bit
    other = buffers(outputs(lambda r: array("f", r), lambda v: array("d", v)))
    for got in (engine, lists, other):
        meta = got[0].view(len(RESPONSES), -1)
        assert meta[:, 2].tolist() == [3, 3, 2] and meta[:, 3].tolist() == [2, 0, 3]
        for buffer, want in zip(got[1:], expected, strict=True):
            assert buffer.dtype == want.dtype and torch.equal(buffer, want)


def test_a_log_prob_count_unlike_the_response_is_refused():
    outs = outputs(lambda r: array("i", r), lambda v: array("f", v + [-1.0]))
    with pytest.raises(RuntimeError, match="returned 3 log-probs for a response of 2 tokens"):
        buffers(outs)
