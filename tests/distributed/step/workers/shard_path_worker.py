"""Worker: the trainer's ``run_step`` on the shard path (each DP rank keeps its samples'
outputs, GAE on the critic's CP shards) equals the flat path (every token gathered to every
rank, GAE over the whole step): the same metrics and the same updated weights of both models.

The models are real (a 4-layer Qwen2 policy and critic from the same random HF weights, both
on one layout); generation and grading are stubs (seeded random responses of 1-20 tokens with
random engine log-probs; odd samples correct), so every difference comes from the data path.
Each case runs one VAPO step twice from the same weights, once per path, with two PPO epochs
(the second epoch's mini-batches split over DP ranks by the step's owners on the shard path),
2-3 micro-batches per rank, the overlong filter and whitening on; a critic-pretraining step
(Monte-Carlo returns on the shards) and a GRPO step (no critic) at the first case's layout.

Usage: python shard_path_worker.py CASE[,CASE...] OUT_DIR  (names in CASES; world size from the
env; each run's rollouts go to its own directory under OUT_DIR).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from train_step_worker import HF_CONFIG, OPTIM, make_weights

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.step import rollout, run
from vapo_megatron.trainer.model_engine import ModelEngine

REPO = Path(__file__).resolve().parents[4]
CASES = {
    "dp2": ModelLayout(),
    "cp2": ModelLayout(cp=2),
    "dp2cp2": ModelLayout(cp=2),
    "tp2sp_cp2": ModelLayout(tp=2, cp=2, sequence_parallel=True),
    "pp2": ModelLayout(pp=2),
    "dp4_few": ModelLayout(),  # 2 samples over DP4: two ranks own none
}
SHAPES = {"dp4_few": (1, 2, 2)}
"""Per case (prompts, samples per prompt, mini-batch size); the rest use (4, 4, 8)."""
VOCAB = HF_CONFIG.vocab_size


class Rollout:
    """Seeded random responses: the same for the same seed and prompts, whatever the path."""

    def generate(self, prompt_ids, *, n, seed, **_):
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i in range(len(prompt_ids) * n):
            length = int(torch.randint(1, 21, (1,), generator=gen))
            ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
            out.append(
                SimpleNamespace(
                    prompt_index=i // n, response_token_ids=ids,
                    logprobs=(-torch.rand(length, generator=gen) * 3).tolist(),
                    finish_reason="length" if length == 20 else "stop",
                )
            )  # fmt: skip
        return out

    def wake_up(self, tags):
        pass

    def sleep(self):
        pass


def grade(items, routing, *, timeout_s):
    results = [
        SimpleNamespace(score=float(i % 2) * 2 - 1, acc=float(i % 2)) for i in range(len(items))
    ]
    return results, SimpleNamespace(num_errors=0, num_timeouts=0)


def run_once(case, path, *, algorithm, pretrain, host, out_dir):
    layout = CASES[case]
    prompts_per_step, n, mini_batch = SHAPES.get(case, (4, 4, 8))
    overrides = [
        f"algorithm.preset={algorithm}",
        f"algorithm.prompts_per_step={prompts_per_step}", f"algorithm.samples_per_prompt={n}",
        f"trainer.mini_batch_size={mini_batch}", "trainer.ppo_epochs=2",
        "trainer.micro_batch_tokens=48",
        "trainer.whiten_advantages=true", "reward.overlong_filter=true",
        "rollout.max_new_tokens=20", f"trainer.gae_path={path}",
    ]  # fmt: skip
    if algorithm == "grpo":
        overrides.append("algorithm.value_pretrain_steps=0")
    config = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", overrides)
    hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
    policy_sd, critic_sd = make_weights()
    groups = build_model_groups(tp=layout.tp, pp=layout.pp, cp=layout.cp, host=host)
    ensure_global_memory_buffer()
    seed_rng_tracker(groups, seed=1)
    policy = ModelEngine(hf, layout, head="lm", optim=OPTIM, groups=groups)
    policy.load_hf(policy_sd)
    critic = None
    if config.algorithm.uses_critic:
        critic = ModelEngine(hf, layout, head="value", optim=OPTIM, groups=groups)
        critic.load_hf(critic_sd)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        SimpleNamespace(
            token_ids=torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),),
                                    generator=gen).tolist(),
            record=SimpleNamespace(index=g, data_source="math", answer="1"),
        )
        for g in range(prompts_per_step)
    ]  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    session = SimpleNamespace(
        config=config, policy=policy, critic=critic, rollout=Rollout(), rollout_synced=True,
        sampler=SimpleNamespace(next_indices=lambda count: list(range(count))),
        train=SimpleNamespace(items=prompts),
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: ""),
        stop_token_ids=[0], routing={}, replica=rank, num_replicas=world, host_group=host,
        rank=rank, run_dir=out_dir / f"{case}-{algorithm}-{pretrain}-{path}-rank{rank}",
        data_path=None,
    )  # fmt: skip
    metrics = run.run_step(session, 3, pretrain=pretrain)
    weights = {}
    for name, engine in (("policy", policy), ("critic", critic)):
        if engine is not None:
            weights.update({f"{name}.{k}": v.clone() for k, v in engine.hf_weights()})
    return metrics, weights


def compare(case, what, flat, shards):
    (m_flat, w_flat), (m_shards, w_shards) = flat, shards
    assert m_flat["data/shard_path"] == 0.0 and m_shards["data/shard_path"] == 1.0, what
    skip = ("time/", "tokens_per_second", "overhead_fraction", "data/shard_path")
    keys = sorted(k for k in m_flat if not k.startswith(skip))
    assert keys == sorted(k for k in m_shards if not k.startswith(skip)), (case, what)
    worst_metric = 0.0
    for key in keys:
        a, b = m_flat[key], m_shards[key]
        diff = abs(a - b) / max(1.0, abs(a))
        assert diff < 1e-5, f"{case} {what}: metric {key} flat {a} shards {b}"
        worst_metric = max(worst_metric, diff)
    assert sorted(w_flat) == sorted(w_shards)
    worst = max((w_flat[k] - w_shards[k]).abs().max().item() for k in w_flat)
    moved = max((w_flat[k] - make_reference(k)).abs().max().item() for k in w_flat)
    assert moved > 1e-4, f"{case} {what}: the step did not change the weights ({moved})"
    assert worst < 1e-5, f"{case} {what}: updated weights differ by {worst}"
    print(
        f"rank {dist.get_rank()}: {case} {what}: {len(keys)} metrics max rel diff "
        f"{worst_metric:.2e}; updated weights max diff {worst:.2e} (step moved them {moved:.2e})"
    )


_REFERENCE: dict[str, torch.Tensor] = {}


def make_reference(key: str) -> torch.Tensor:
    if not _REFERENCE:
        policy_sd, critic_sd = make_weights()
        _REFERENCE.update({f"policy.{k}": v for k, v in policy_sd.items()})
        _REFERENCE.update({f"critic.{k}": v for k, v in critic_sd.items()})
    return _REFERENCE[key]


def main(cases: list[str], out_dir: Path) -> None:
    torch.manual_seed(0)
    initialize_cpu_process_group()
    host = make_host_group()
    rollout.score_responses = grade  # the grader is not the data path
    run.sync_weights = lambda session: {}  # nor is the weight stream
    for k, case in enumerate(cases):
        runs = [("vapo", "vapo", False)]
        if k == 0:
            runs += [("critic pretraining", "vapo", True), ("grpo", "grpo", False)]
        for what, algorithm, pretrain in runs:
            results = [
                run_once(
                    case, path, algorithm=algorithm, pretrain=pretrain, host=host, out_dir=out_dir
                )
                for path in ("flat", "shards")
            ]
            compare(case, what, *results)
    dist.barrier(host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
