"""Worker: Megatron policy -> weight stream -> vLLM, checked against transformers.

With engine TP=1 every trainer rank hosts its own vLLM engine (colocated rollout); with
engine TP=2, rank 0 hosts one engine whose two workers are separate processes, and rank 1
only takes part in the stream. For each Megatron layout (TP2, PP2 over the 2 ranks):
1. load weights A into Megatron, stream them into vLLM: greedy tokens equal transformers' on A;
   vLLM's log-probs of its tokens agree with the Megatron policy's (scoring pass);
2. one optimizer step in Megatron, stream: vLLM's greedy tokens change and equal transformers'
   on the updated weights (gathered back from Megatron);
3. load B, stream (equals transformers on B), load A again, stream: exactly step 1's output.

Usage: python sync_worker.py HF_DIR_OF_A ENGINE_TP
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from transformers import Qwen2Config, Qwen2ForCausalLM

from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.data.packing import Sample, pad
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import ModelLayout
from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
from vapo_megatron.rollout.weight_stream import stream_policy_weights
from vapo_megatron.trainer.loss_fns import logprob_scoring_fn, policy_loss_fn
from vapo_megatron.trainer.model_engine import ModelEngine, OptimSettings

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


def sync(engine: ModelEngine, rollout: RolloutEngine | None, engine_tp: int) -> None:
    """Stream the policy into the engines. Every rank takes part; with one TP>1 engine on
    rank 0, only rank 0 receives tensors (the others only send their shards)."""
    buckets = stream_policy_weights(
        engine.chunks, engine.record, engine.config,
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        bucket_bytes=256 * 1024, receiver=None if engine_tp == 1 else 0,
    )  # fmt: skip
    named = [named for bucket in buckets for named in bucket] if rollout is None else None
    if rollout is None:
        assert named == [], "a rank without an engine received tensors"
    else:
        rollout.update_weights(named for bucket in buckets for named in bucket)


def greedy(rollout: RolloutEngine | None, engine_tp: int):
    """Greedy tokens and log-probs: each rank's own engine (TP=1), or rank 0's (TP>1)."""
    if engine_tp == 1:
        samples = rollout.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)
        return [s.response_token_ids for s in samples], [s.logprobs for s in samples]
    result = [None]
    if dist.get_rank() == 0:
        samples = rollout.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)
        result = [([s.response_token_ids for s in samples], [s.logprobs for s in samples])]
    dist.broadcast_object_list(result, src=0)
    return result[0]


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
        [mb.response_mask], [mb.fields["positive"]], len(samples), dp_cp_group=None, cp_size=1
    )
    fn = policy_loss_fn(algo_preset("vapo"), norm, engine.vocab_slice)
    engine.run([mb], fn)
    engine.step()


def main(hf_dir: str, engine_tp: int) -> None:
    state_a, state_b = weights(0), weights(1)
    expected_a, expected_b = hf_greedy(state_a), hf_greedy(state_b)
    assert expected_a != expected_b
    initialize_megatron_cpu(tp=1)
    if dist.get_rank() == 0:  # the engine starts from A's HF checkpoint
        model = Qwen2ForCausalLM(CONFIG)
        model.load_state_dict(state_a)
        model.save_pretrained(hf_dir)
    dist.barrier()
    rollout = None
    if engine_tp == 1 or dist.get_rank() == 0:
        rollout = RolloutEngine(
            RolloutConfig(
                model_path=hf_dir,
                dtype="float32",
                max_model_len=256,
                tensor_parallel_size=engine_tp,
            )
        )
    hf = HFModelConfig.from_hf(CONFIG.to_dict())
    rank = dist.get_rank()
    for name, layout in (("TP2", ModelLayout(tp=2)), ("PP2", ModelLayout(pp=2))):
        initialize_megatron_cpu(tp=layout.tp, pp=layout.pp)
        engine = ModelEngine(hf, layout, head="lm", optim=OptimSettings(lr=3e-2, clip_grad=0.0))
        engine.load_hf(state_a)
        sync(engine, rollout, engine_tp)
        tokens_a, logprobs_a = greedy(rollout, engine_tp)
        assert tokens_a == expected_a, (name, tokens_a, expected_a)
        gap = logprob_agreement(engine, tokens_a, logprobs_a)
        assert gap < 1e-4, f"{name}: mean |exp(logp_vllm - logp_mcore) - 1| = {gap}"
        print(f"rank {rank}: {name}: greedy equals transformers; logprob gap {gap:.2e}")

        train_one_step(engine, tokens_a, logprobs_a)
        sync(engine, rollout, engine_tp)
        tokens_trained, _ = greedy(rollout, engine_tp)
        assert tokens_trained != tokens_a, f"{name}: one optimizer step did not reach vLLM"
        assert tokens_trained == hf_greedy(gathered_state(engine)), name
        print(f"rank {rank}: {name}: the trained step is visible in vLLM's next generation")

        engine.load_hf(state_b)
        sync(engine, rollout, engine_tp)
        assert greedy(rollout, engine_tp)[0] == expected_b, name
        engine.load_hf(state_a)
        sync(engine, rollout, engine_tp)
        assert greedy(rollout, engine_tp) == (tokens_a, logprobs_a), (
            f"{name}: A -> B -> A is not exact"
        )
        print(f"rank {rank}: {name}: A -> B -> A returns exactly A's tokens and log-probs")
    dist.barrier()
    # vLLM adopts the default group (TP=1) and tears it down with the engine: shut it down last.
    if rollout is not None:
        rollout.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
