"""Worker: ``generate_and_grade`` on 2 gloo ranks (2 replicas) with a fake engine and grader.

Every rank must get every replica's trajectories in (group, sample) order, through tensor
gathers only (the object gather is made to raise), equal to what one process builds from
each replica's generation.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives
from vapo_megatron.step import rollout
from vapo_megatron.step.rollout import RolloutStats, generate_and_grade, replica_share

NUM_PROMPTS, N = 5, 3


class FakeEngine:
    """Response j of prompt p: a token list whose length and ids follow from (p, j, seed)."""

    def generate(self, prompt_ids, *, n, seed, max_new_tokens, **_):
        out = []
        for p, ids in enumerate(prompt_ids):
            for j in range(n):
                length = (ids[0] * 7 + j * 3 + seed) % (max_new_tokens + 1)
                response = [(ids[0] + j + k) % 97 for k in range(length)]
                out.append(
                    SimpleNamespace(
                        prompt_index=p, response_token_ids=response,
                        logprobs=[-0.01 * (k + 1) for k in range(length)],
                        finish_reason="length" if length == max_new_tokens else "stop",
                    )
                )  # fmt: skip
        return out


def grade(items, routing, *, timeout_s):
    results = [
        SimpleNamespace(score=1.0 if len(text) % 2 else -1.0, acc=float(len(text) % 2))
        for _, text, _ in items
    ]
    return results, SimpleNamespace(num_errors=1, num_timeouts=0)


def no_objects(*args, **kwargs):
    raise AssertionError("trajectories must not travel as pickled objects")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    host = collectives.make_host_group()
    rollout.score_responses = grade
    collectives.all_gather_objects = no_objects
    prompts = [
        SimpleNamespace(
            token_ids=[10 + g, 3, 4][: 1 + g % 3],
            record=SimpleNamespace(index=100 + g, data_source="x", answer="y"),
        )
        for g in range(NUM_PROMPTS)
    ]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "a" * len(ids))
    stats = RolloutStats()
    common = dict(
        n=N, temperature=1.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[0],
        routing={}, grader_timeout_s=1.0, num_replicas=2, host_group=host,
    )  # fmt: skip
    got = generate_and_grade(
        FakeEngine(), tokenizer, prompts, seed=rank, stats=stats, replica=rank, **common
    )
    assert stats.grader_errors == 2, stats  # one per replica, summed
    # The reference: each replica's generation, in group order.
    expected = []
    for replica in range(2):
        share = replica_share(NUM_PROMPTS, 2, replica)
        outs = FakeEngine().generate(
            [prompts[g].token_ids for g in share], n=N, seed=replica, max_new_tokens=6
        )
        for o in outs:
            expected.append((share[o.prompt_index], o))
    assert len(got) == NUM_PROMPTS * N, len(got)
    for i, (group, o) in enumerate(expected):
        assert int(got.group[i]) == group and int(got.prompt_index[i]) == 100 + group
        assert got.prompts[i].tolist() == prompts[group].token_ids
        assert got.responses[i].tolist() == o.response_token_ids, (i, got.responses[i])
        lo, hi = int(got.responses.offsets[i]), int(got.responses.offsets[i + 1])
        assert got.rollout_logprobs[lo:hi].tolist() == torch.tensor(o.logprobs).tolist()
        assert bool(got.truncated[i]) == (o.finish_reason == "length")
        assert float(got.acc[i]) == float(len(o.response_token_ids) % 2)
    assert got.responses.values.dtype == torch.int32
    assert got.rollout_logprobs.dtype == torch.float32
    print(f"TRAJECTORY_GATHER_OK rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
