"""Worker: Megatron policy -> weight stream -> vLLM engine replicas, checked against transformers.

Every rank hosts its share of a vLLM engine (external_launcher): with engine TP k, each k
consecutive ranks form one replica, world / k replicas in all; every rank receives every full
HF tensor from the stream (in process) and its vLLM worker keeps its TP slice. Replica r
generates the prompts rotated by r, so replicas answer different requests. For each Megatron
layout (TP2, PP2; DP takes the remaining ranks):
1. load weights A into Megatron, stream them into vLLM: greedy tokens equal transformers' on A
   on every replica, identical on the ranks of one replica; vLLM's log-probs of its tokens
   agree with the Megatron policy's (scoring pass);
2. one optimizer step in Megatron, stream: vLLM's greedy tokens change and equal transformers'
   on the updated weights (gathered back from Megatron);
3. load B, stream (equals transformers on B), load A again, stream: exactly step 1's output.
Then the sleep/wake order on the real engine: a sync or a generate in the wrong state raises,
and the right order gives A's tokens again. Per rank: the peak extra memory of a sync.

Usage: python sync_worker.py HF_DIR_OF_A ENGINE_TP
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from transformers import Qwen2Config, Qwen2ForCausalLM

from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
from vapo_megatron.rollout.sleep_state import EngineStateError
from vapo_megatron.step.losses import logprob_scoring_fn, policy_loss_fn
from vapo_megatron.step.weight_sync import push_policy_weights
from vapo_megatron.weights.gather import GatherBuffers
from vapo_megatron.weights.stream import stream_policy_weights

VOCAB = 300
CONFIG = Qwen2Config(
    hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    intermediate_size=256, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=512,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 2], [7] * 12]
NEW_TOKENS = 12


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(CONFIG).float()
    # Larger weights than the default init make the greedy path depend on them sharply.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def hf_greedy(state: dict[str, torch.Tensor]) -> list[list[int]]:
    model = Qwen2ForCausalLM(CONFIG).float().eval()
    model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


def replica_prompts(replica: int) -> list[list[int]]:
    """Replica r answers the prompts rotated by r (so replicas get different requests)."""
    r = replica % len(PROMPTS)
    return PROMPTS[r:] + PROMPTS[:r]


def unrotate(rows: list, replica: int) -> list:
    """Back to PROMPTS order."""
    r = replica % len(PROMPTS)
    return rows[len(rows) - r :] + rows[: len(rows) - r]


SYNC_BUFFERS = GatherBuffers(limit_bytes=256 * 1024)


def sync(
    engine: ModelEngine, rollout: RolloutEngine, bucket_bytes: int = 256 * 1024, prefetch=None
):
    """Stream the policy into this rank's engine the trainer's way (every rank receives every
    tensor; small messages, so that layers and q/k/v fall across message boundaries), with one
    pool of gather buffers kept across syncs, so that reused buffers meet a live engine.
    ``prefetch=True`` is the GPU default (the stream one message ahead in a thread)."""
    return push_policy_weights(
        engine, rollout, bucket_bytes=bucket_bytes, buffers=SYNC_BUFFERS, prefetch=prefetch
    )


def greedy(rollout: RolloutEngine):
    """Greedy tokens and log-probs of this rank's replica, in PROMPTS order. Checks that the
    ranks of one replica got exactly the same output."""
    samples = rollout.generate(
        replica_prompts(rollout.replica), n=1, temperature=0.0, max_new_tokens=NEW_TOKENS
    )
    tokens = unrotate([s.response_token_ids.tolist() for s in samples], rollout.replica)
    logprobs = unrotate([s.logprobs.tolist() for s in samples], rollout.replica)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rollout.replica, tokens, logprobs))
    for replica, other_tokens, other_logprobs in everyone:
        if replica == rollout.replica:
            assert (other_tokens, other_logprobs) == (tokens, logprobs), "a replica's ranks differ"
    return tokens, logprobs


def gathered_state(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """The full updated weights on every rank (stream = TP gather + PP broadcast)."""
    state = {}
    for bucket in stream_policy_weights(
        engine.chunks, engine.record, engine.config,
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        bucket_bytes=1 << 30,
    ):  # fmt: skip
        state.update({name: t.clone() for name, t in bucket})
    return state


def logprob_agreement(engine: ModelEngine, tokens, vllm_logprobs) -> float:
    """Mean |exp(logp_vllm - logp_mcore) - 1| over the generated tokens."""
    samples = [Sample(prompt, response) for prompt, response in zip(PROMPTS, tokens, strict=True)]
    mb = pad(samples, pad_multiple=8)
    outs = engine.run([mb], logprob_scoring_fn(engine.vocab_slice), forward_only=True)
    gap = torch.zeros(2, dtype=torch.float64)  # sum, count
    if ps.is_pipeline_last_stage():
        mcore = outs[0]["logprobs"][mb.response_mask]
        vllm = torch.tensor([lp for row in vllm_logprobs for lp in row], dtype=torch.float64)
        gap[0] = (torch.exp(vllm - mcore.double()) - 1).abs().sum()
        gap[1] = vllm.numel()
    dist.all_reduce(gap, group=ps.get_pipeline_model_parallel_group())
    return (gap[0] / gap[1]).item()


def train_one_step(engine: ModelEngine, tokens, logprobs) -> None:
    """A policy-gradient step that pushes the greedy tokens down (negative advantages)."""
    samples = [
        Sample(prompt, response, {
            "old_logprobs": torch.tensor(old),
            "advantages": -torch.ones(len(response)),
            "positive": torch.zeros(len(response), dtype=torch.bool),
        })
        for prompt, response, old in zip(PROMPTS, tokens, logprobs, strict=True)
    ]  # fmt: skip
    mb = pad(samples, pad_multiple=8)
    norm = global_loss_normalisers(
        [mb.response_mask],
        [mb.fields["positive"]],
        len(samples),
        dp_cp_group=None,
        cp_size=1,
        device=torch.device("cpu"),
    )
    fn = policy_loss_fn(algo_preset("vapo"), norm, engine.vocab_slice)
    engine.run([mb], fn)
    engine.step()


def check_sleep_order(engine: ModelEngine, rollout: RolloutEngine, tokens_a) -> None:
    """The sleep/wake order on the real engine (on CPU only the bookkeeping, no vLLM calls)."""
    rollout.sleep()
    try:
        sync(engine, rollout)
        raise AssertionError("a sync into a sleeping engine did not raise")
    except EngineStateError:
        pass
    rollout.wake_up(["weights"])
    try:
        greedy(rollout)
        raise AssertionError("generating with the KV cache asleep did not raise")
    except EngineStateError:
        pass
    sync(engine, rollout)
    rollout.wake_up(["kv_cache"])
    assert greedy(rollout)[0] == tokens_a


def main(hf_dir: str, engine_tp: int) -> None:
    state_a, state_b = weights(0), weights(1)
    expected_a, expected_b = hf_greedy(state_a), hf_greedy(state_b)
    assert expected_a != expected_b
    initialize_megatron_cpu(tp=1)
    rank = dist.get_rank()
    if rank == 0:  # the engine starts from A's HF checkpoint
        model = Qwen2ForCausalLM(CONFIG)
        model.load_state_dict(state_a)
        model.save_pretrained(hf_dir)
    dist.barrier()
    start = time.perf_counter()
    rollout = RolloutEngine(
        RolloutConfig(
            model_path=hf_dir, dtype="float32", max_model_len=256, tensor_parallel_size=engine_tp,
            kv_cache_bytes=64 << 20, seed=rank // engine_tp,
        )
    )  # fmt: skip
    print(
        f"rank {rank}: replica {rollout.replica} of {dist.get_world_size() // engine_tp} "
        f"(vLLM TP {engine_tp}) up in {time.perf_counter() - start:.1f} s"
    )
    hf = HFModelConfig.from_hf(CONFIG.to_dict())
    layouts = (("TP2", ModelLayout(tp=2)), ("PP2", ModelLayout(pp=2)))
    for name, layout in layouts:
        initialize_megatron_cpu(tp=layout.tp, pp=layout.pp)
        engine = ModelEngine(hf, layout, head="lm", optim=OptimSettings(lr=3e-2, clip_grad=0.0))
        engine.load_hf(state_a)
        before = rollout.reset_peak_memory()[0]
        stats = sync(engine, rollout)
        extra = rollout.peak_memory()[0] - before
        print(
            f"rank {rank}: {name}: sync of {stats.num_bytes / 1e6:.2f} MB in {stats.num_buckets} "
            f"buckets, {stats.seconds:.3f} s (engine load {stats.load_seconds:.3f} s), peak "
            f"extra memory {extra / 1e6:.1f} MB"
        )
        tokens_a, logprobs_a = greedy(rollout)
        assert tokens_a == expected_a, (name, tokens_a, expected_a)
        gap = logprob_agreement(engine, tokens_a, logprobs_a)
        assert gap < 1e-4, f"{name}: mean |exp(logp_vllm - logp_mcore) - 1| = {gap}"
        print(f"rank {rank}: {name}: greedy equals transformers; logprob gap {gap:.2e}")

        train_one_step(engine, tokens_a, logprobs_a)
        sync(engine, rollout)
        tokens_trained, _ = greedy(rollout)
        assert tokens_trained != tokens_a, f"{name}: one optimizer step did not reach vLLM"
        assert tokens_trained == hf_greedy(gathered_state(engine)), name
        print(f"rank {rank}: {name}: the trained step is visible in vLLM's next generation")

        engine.load_hf(state_b)
        sync(engine, rollout, prefetch=True)
        assert greedy(rollout)[0] == expected_b, name
        engine.load_hf(state_a)
        sync(engine, rollout, prefetch=True)
        assert greedy(rollout) == (tokens_a, logprobs_a), f"{name}: A -> B -> A is not exact"
        print(
            f"rank {rank}: {name}: A -> B -> A returns exactly A's tokens and log-probs "
            "(B and A synced with prefetch)"
        )
    check_sleep_order(engine, rollout, tokens_a)
    print(f"rank {rank}: sleep/wake order enforced; the right order gives A's tokens")
    dist.barrier()
    # vLLM adopted the default group and tears it down with the engine: shut it down last.
    rollout.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
