"""Worker: the trainer's ``run_step`` on the routed data path (each model scores and trains on
its own DP ranks' samples, GAE on the critic's owners, the critic's advantages sent to the
policy's owners where they differ) equals a single-rank reference run of the same step: the
same metrics and the same updated weights of both models.

The models are real (a 4-layer Qwen2 policy and critic from the same random HF weights, each on
its own layout and process groups); generation and grading are stubs whose output depends on
the prompts alone, not on which replica generates them (each response starts with its index in
the group, whose parity grades it; the rest is seeded by the prompt), so a world of 1 and a
world of 4 step on the same trajectories and every difference comes from the data path. Each
case runs one VAPO step with two PPO epochs (the second epoch's mini-batches split over DP
ranks by the step's owners), 2-3 micro-batches per rank, the overlong filter and whitening on;
the first case also a critic-pretraining step (Monte-Carlo returns) and a GRPO step (no
critic).

Usage: python shard_path_worker.py ref|run CASE[,CASE...] OUT_DIR. ``ref`` (world 1) saves the
reference of each case's shape under OUT_DIR; ``run`` (the case's world) compares with it.
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
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.collectives import all_gather_objects, make_host_group
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.step import rollout, run
from vapo_megatron.step.context import StepContext

REPO = Path(__file__).resolve().parents[4]
ONE = ModelLayout()
CASES = {
    # name: (policy layout, critic layout); the models' DP sizes follow from the world's
    "tp2_x_dp2": (ModelLayout(tp=2, sequence_parallel=True), ONE),  # world 2: routed
    "pp2_x_cp2": (ModelLayout(pp=2), ModelLayout(cp=2)),  # world 2: routed, critic on CP shards
    "dp2": (ONE, ONE),  # world 2: one layout, nothing per token crosses ranks
    "dp4_few": (ONE, ModelLayout(tp=2)),  # world 4: 2 samples, policy DP4 (two ranks own none)
    "cp2pp2": (ModelLayout(cp=2, pp=2), ModelLayout(cp=2, pp=2)),  # world 4: CP shards reassembled
    "tp2sp_cp2": (ModelLayout(tp=2, cp=2, sequence_parallel=True),) * 2,  # world 4: GAE on shards
}
ROUTED = {"tp2_x_dp2", "pp2_x_cp2", "dp4_few"}
SHAPES = {"dp4_few": (1, 2, 2)}
"""Per case (prompts, samples per prompt, mini-batch size); the rest use (4, 4, 8)."""
VOCAB = HF_CONFIG.vocab_size


class Rollout:
    """Responses that depend on the prompt alone: sample k of a group starts with token k + 1
    (graded by its parity), then 0-19 tokens seeded by the prompt's ids and k."""

    state = SimpleNamespace(asleep=False)

    def generate(self, prompt_ids, *, n, seed, **_):
        out = []
        for i in range(len(prompt_ids) * n):
            prompt, k = list(prompt_ids[i // n]), i % n
            gen = torch.Generator().manual_seed(sum(t * 31**j for j, t in enumerate(prompt)) + k)
            length = int(torch.randint(1, 21, (1,), generator=gen))
            ids = [k + 1] + torch.randint(1, VOCAB, (length - 1,), generator=gen).tolist()
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
    """Odd samples of a group correct: the text is the response's first id (``decode``)."""
    results = []
    for _, text, _ in items:
        correct = float(int(text) % 2 == 0)  # first id k + 1: even for odd k
        results.append(SimpleNamespace(score=correct * 2 - 1, acc=correct))
    return results, SimpleNamespace(num_errors=0, num_timeouts=0)


def run_once(case, *, reference, algorithm, pretrain, host, out_dir):
    """One step of ``case`` (on one rank with ``reference``): (metrics, updated HF weights)."""
    policy_layout, critic_layout = (ONE, ONE) if reference else CASES[case]
    prompts_per_step, n, mini_batch = SHAPES.get(case, (4, 4, 8))
    overrides = [
        f"algorithm.preset={algorithm}",
        f"algorithm.prompts_per_step={prompts_per_step}", f"algorithm.samples_per_prompt={n}",
        f"trainer.mini_batch_size={mini_batch}", "trainer.ppo_epochs=2",
        "trainer.micro_batch_tokens=48",
        "trainer.whiten_advantages=true", "reward.overlong_filter=true",
        "rollout.max_new_tokens=20",
    ]  # fmt: skip
    if algorithm == "grpo":
        overrides.append("algorithm.value_pretrain_steps=0")
    config = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", overrides)
    hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
    policy_sd, critic_sd = make_weights()
    engines = {}
    for role, layout, head, sd in (
        ("policy", policy_layout, "lm", policy_sd), ("critic", critic_layout, "value", critic_sd)
    ):  # fmt: skip
        if role == "critic" and not config.algorithm.uses_critic:
            continue
        groups = build_model_groups(tp=layout.tp, pp=layout.pp, cp=layout.cp, host=host)
        ensure_global_memory_buffer()
        seed_rng_tracker(groups, seed=1)
        engines[role] = ModelEngine(hf, layout, head=head, optim=OPTIM, groups=groups)
        engines[role].load_hf(sd)
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
    session = StepContext(
        config=config, policy=engines["policy"], critic=engines.get("critic"), rollout=Rollout(),
        weights_current=True,
        sampler=SimpleNamespace(next_indices=lambda count: list(range(count))),
        train_prompts=prompts,
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids[0])),
        stop_token_ids=[0], routing={}, replica=rank, num_replicas=world, host_group=host,
        rank=rank, run_dir=out_dir / f"{case}-{algorithm}-{pretrain}-{reference}-rank{rank}",
    )  # fmt: skip
    metrics = run.run_step(session, 3, pretrain=pretrain)
    weights = {}
    for name, engine in engines.items():
        weights.update({f"{name}.{k}": v.clone() for k, v in engine.hf_weights()})
    return metrics, weights


SKIP = ("time/", "tokens_per_second", "overhead_fraction", "data/shard_path")


def compare(case, what, reference, routed):
    (m_ref, w_ref), (m_routed, w_routed) = reference, routed
    assert m_routed["data/shard_path"] == float(case not in ROUTED or what != "vapo"), (case, what)
    keys = sorted(k for k in m_ref if not k.startswith(SKIP))
    assert keys == sorted(k for k in m_routed if not k.startswith(SKIP)), (case, what)
    worst_metric = 0.0
    for key in keys:
        a, b = m_ref[key], m_routed[key]
        diff = abs(a - b) / max(1.0, abs(a))
        assert diff < 1e-5, f"{case} {what}: metric {key} reference {a} routed {b}"
        worst_metric = max(worst_metric, diff)
    # Under PP each stage gathers its own layers: together the ranks cover every weight.
    covered = set().union(*all_gather_objects(sorted(w_routed), dist.group.WORLD))
    assert covered == set(w_ref), (case, what, sorted(covered ^ set(w_ref))[:4])
    worst = max((w_ref[k] - w_routed[k]).abs().max().item() for k in w_routed)
    moved = max((w_ref[k] - make_reference(k)).abs().max().item() for k in w_routed)
    assert moved > 1e-4, f"{case} {what}: the step did not change the weights ({moved})"
    assert worst < WEIGHT_TOLERANCE, f"{case} {what}: updated weights differ by {worst}"
    print(
        f"rank {dist.get_rank()}: {case} {what}: {len(keys)} metrics max rel diff "
        f"{worst_metric:.2e}; updated weights max diff {worst:.2e} (step moved them {moved:.2e})"
    )


WEIGHT_TOLERANCE = 2e-5
"""Four Adam steps at lr 1e-3 in float32: layouts sum in other orders."""
_REFERENCE: dict[str, torch.Tensor] = {}


def make_reference(key: str) -> torch.Tensor:
    if not _REFERENCE:
        policy_sd, critic_sd = make_weights()
        _REFERENCE.update({f"policy.{k}": v for k, v in policy_sd.items()})
        _REFERENCE.update({f"critic.{k}": v for k, v in critic_sd.items()})
    return _REFERENCE[key]


def main(mode: str, cases: list[str], out_dir: Path) -> None:
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
            saved = out_dir / f"reference-{SHAPES.get(case, 'default')}-{what}.pt"
            if mode == "ref" and saved.exists():
                continue
            result = run_once(
                case, reference=mode == "ref", algorithm=algorithm, pretrain=pretrain,
                host=host, out_dir=out_dir,
            )  # fmt: skip
            if mode == "ref":
                torch.save(result, saved)
            else:
                compare(case, what, torch.load(saved), result)
    dist.barrier(host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3]))
