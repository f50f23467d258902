"""Step 6: rewards and the critic's values of the tokens a rank holds -> advantages, critic
targets and the step's statistics, on the critic's owners (``step/advantage_exchange.py``).

The reward sits at each response's last token (the state after it is terminal, value 0); GAE
uses lambda_policy(l) per sequence for advantages and lambda_critic for returns; critic
pretraining's targets are the Monte-Carlo returns (lambda = gamma = 1); the group estimator
(GRPO/DAPO) broadcasts each sample's group-normalised score over its tokens. Where a rank
holds whole sequences (its own samples without CP, or reassembled under CP with PP) GAE is
one packed scan over them; under CP without PP ``gae_on_cp_shards`` runs it on the critic's
context-parallel shards during scoring, with one carry per sequence across CP ranks. The
advantages then go to the policy's side (``Scored.to_policy``). The statistics are float64
sums over the counted tokens (``step/token_sums.py``), so any split gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.advantages import decoupled_gae_packed, gae_lambdas
from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import group_normalized_advantages
from vapo_megatron.algorithms.masks import any_true
from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.parallel.cp_gae import gae_context_parallel_packed
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import FLAT_INDEX
from vapo_megatron.step.importance import StaleTraces
from vapo_megatron.step.outputs import Scored, Side, StepInputs, TokenFields
from vapo_megatron.step.token_sums import (
    TokenSums,
    critic_metrics,
    failing_advantage_metrics,
    first_token_metrics,
    lambda_metrics,
    logprob_gap_sum,
    profile_metrics,
)


def terminal_rewards(
    rewards: Sequence[float] | torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """[N] zeros with rewards[i] at sample i's last response token (offsets: [S + 1])."""
    flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=offsets.device)
    if (offsets.diff() < 1).any():
        raise ValueError("every sample needs at least one response token to carry its reward")
    flat[offsets[1:] - 1] = torch.as_tensor(rewards, dtype=torch.float32, device=offsets.device)
    return flat


def gae_advantages(
    algo: AlgoConfig,
    rewards: Sequence[float] | torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    ratios: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages [N], returns [N], lambda_policy [S]) from the critic's values [N]; with
    ``ratios`` [N] (pi_old / mu of stale samples, ``step/importance.py``) V-trace GAE with
    the algorithm's rho_bar and c_bar in both lambdas."""
    flat_rewards = terminal_rewards(rewards, offsets)
    # Every token is a response token: one True seen N times, not an [N] buffer.
    mask = torch.ones(1, dtype=torch.bool, device=offsets.device).expand(flat_rewards.numel())
    traces = (
        {} if ratios is None else {"ratios": ratios, "rho_bar": algo.rho_bar, "c_bar": algo.c_bar}
    )
    return decoupled_gae_packed(algo, flat_rewards, values, mask, offsets, **traces)


def monte_carlo_returns(
    rewards: Sequence[float] | torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Critic-pretraining targets: returns with lambda = gamma = 1 (the Monte-Carlo return)."""
    _, returns, _ = gae_advantages(monte_carlo_config(), rewards, values, offsets)
    return returns


def monte_carlo_config() -> AlgoConfig:
    """GAE settings whose returns are the Monte-Carlo return (lambda_critic = gamma = 1)."""
    return AlgoConfig(
        lambda_critic=1.0, gamma=1.0, decoupled_gae=True, length_adaptive_alpha=None,
        value_pretrain_steps=0,
    )  # fmt: skip


def group_advantages(
    algo: AlgoConfig, rewards: Sequence[float] | torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """[N]: each sample's group-normalised reward on all of its tokens (GRPO / DAPO)."""
    return torch.repeat_interleave(group_sample_advantages(algo, rewards), offsets.diff())


def group_sample_advantages(
    algo: AlgoConfig, rewards: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """[S]: each sample's reward normalised over its group (samples_per_prompt consecutive
    samples)."""
    return group_normalized_advantages(
        torch.as_tensor(rewards, dtype=torch.float32, device=HOST),
        algo.samples_per_prompt,
        scale_by_std=algo.group_scale_by_std,
    )  # fmt: skip


def whiten(x: torch.Tensor, sums: TokenSums, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit std over the step's response tokens (the global batch), whichever
    rank holds them: ``sums`` counts each token once over the job."""
    return whiten_(x.clone(), sums, eps)


def whiten_(x: torch.Tensor, sums: TokenSums, eps: float = 1e-8) -> torch.Tensor:
    """:func:`whiten` in place (the same float32 operations, so the same bits): the step's
    advantages are whitened where GAE left them, with no second step-sized buffer."""
    mean, std = sums.mean_std(x)
    return x.sub_(mean).div_(std + eps)


def gae_on_cp_shards(
    algo: AlgoConfig,
    micro_batches: Sequence[MicroBatch],
    values: Sequence[torch.Tensor],
    sample_ids: torch.Tensor,
    rewards: torch.Tensor,
    offsets: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    *,
    traces: StaleTraces | None = None,
    logprobs: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Decoupled GAE where the critic scored: on this rank's context-parallel shards.

    micro_batches: this rank's packed (THD) micro-batches, as ``batching.micro_batches`` cut
    them for its CP rank, holding the samples ``sample_ids`` [K] in order (``num_seqs`` each;
    an empty micro-batch holds none); values: per micro-batch, the critic's outputs on its
    positions ([t_local] or [1, t_local]; read only on the response mask); rewards [S] and
    offsets [S + 1]: the whole step's per-sample rewards and response offsets (S + 1 numbers,
    not per token). Each sequence's lambdas come from its full response length, and
    ``parallel/cp_gae.py`` carries one number per chunk across ``cp_group`` (every CP rank of
    this data-parallel rank holds the same micro-batches, so each call is collective over it).
    Returns (advantages, returns) per micro-batch, [t_local] float32 on the values' device (0
    off the response mask), equal to :func:`gae_advantages`' at each token's ``flat_index``, and
    lambda_policy [K] of ``sample_ids``. With ``traces`` (stale samples), V-trace GAE: the
    ratios from the policy's log-probs of the same micro-batches ``logprobs`` (one layout),
    or from the traces' gathered ones (None: the routed path).
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    lengths = offsets.diff()[sample_ids]
    lam_policy, lam_critic = gae_lambdas(algo, lengths)
    last = offsets[1:] - 1  # flat position of each sample's last response token
    advantages, returns = [], []
    start = 0
    for k, (mb, value) in enumerate(zip(micro_batches, values, strict=True)):
        device = value.device  # the critic's: its CP group's collective takes tensors there
        mask = mb.response_mask.reshape(-1).to(device)
        if mb.num_seqs == 0:
            zeros = torch.zeros(mask.numel(), dtype=torch.float32, device=device)
            advantages.append(zeros)
            returns.append(zeros.clone())
            continue
        ids = sample_ids[start : start + mb.num_seqs]
        start += mb.num_seqs
        flat_index = mb.fields[FLAT_INDEX].reshape(-1).to(device)
        cu_padded = mb.packed_seq_params.cu_seqlens_q_padded.to(device)
        local = cu_padded.diff().long() // cp_size  # this rank's positions of each sequence
        is_last = mask & (flat_index == last[ids].to(device).repeat_interleave(local))
        reward = rewards[ids].to(device, torch.float32).repeat_interleave(local)
        token_rewards = torch.where(is_last, reward, 0.0)
        value = value.reshape(-1).to(torch.float32)
        kw = {}
        if traces is not None:
            old = None if logprobs is None else logprobs[k].reshape(-1)
            kw = traces.gae_kwargs(_shard_ratios(traces, flat_index, mask, old).to(device))
        if cp_size == 1:  # whole sequences here: the packed scan, lambdas from the mask
            adv, ret, _ = decoupled_gae_packed(algo, token_rewards, value, mask, cu_padded, **kw)
            advantages.append(adv.to(torch.float32))
            returns.append(ret.to(torch.float32))
            continue
        span = slice(start - mb.num_seqs, start)
        lams = [lam_policy[span]]
        if lam_critic is not lam_policy:
            lams.append(lam_critic[span])
        results = [
            gae_context_parallel_packed(
                token_rewards, value, mask, cu_padded, lam, algo.gamma, cp_group, **kw
            )
            for lam in lams
        ]
        advantages.append(results[0][0].to(torch.float32))
        returns.append(results[-1][1].to(torch.float32))
    if start != sample_ids.numel():
        raise ValueError(
            f"micro-batches hold {start} samples, sample_ids {sample_ids.numel()}: pass the "
            "samples in the order the micro-batches were packed"
        )
    return advantages, returns, lam_policy


def _shard_ratios(
    traces: StaleTraces,
    flat_index: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
) -> torch.Tensor:
    """[t_local] r of a micro-batch's positions (1 off the response mask, whose flat index
    is padding)."""
    flat_index, mask = flat_index.to(HOST), mask.to(HOST)
    ratios = torch.ones(flat_index.numel(), dtype=torch.float32, device=HOST)
    old = None if old_logprobs is None else old_logprobs.to(HOST)[mask]
    ratios[mask] = traces.ratios_at(flat_index[mask], old)
    return ratios


class CriticShardGae:
    """Row 6 where row 5 leaves the critic's values on context-parallel shards (CP without a
    pipeline, ``step/scoring_pass.py``): the scoring pass hands each chunk's values here as they
    come out, and this runs ``gae_on_cp_shards`` on them (the scan and the CP carry live here,
    not in the scoring pass). ``names``: the per-token outputs it gives (critic pretraining's
    Monte-Carlo targets have no advantages)."""

    def __init__(self, algo: AlgoConfig, inputs: StepInputs, *, monte_carlo: bool) -> None:
        self.algo = monte_carlo_config() if monte_carlo else algo
        self.rewards, self.offsets = inputs.rewards, inputs.responses.offsets
        self.traces = None if monte_carlo else inputs.traces
        self.names = ["returns"] if monte_carlo else ["returns", "advantages"]

    def __call__(
        self,
        micro_batches: Sequence[MicroBatch],
        sample_ids: Sequence[int],
        values: Sequence[torch.Tensor],
        cp_group: dist.ProcessGroup | None,
        logprobs: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, list[torch.Tensor]]:
        """name -> per micro-batch [t_local] float32 outputs of ``names`` (collective over
        ``cp_group``); ``logprobs``: the policy's outputs on the same micro-batches, where one
        pass scored them (the stale samples' ratios)."""
        ids = torch.tensor(list(sample_ids), dtype=torch.long, device=HOST)
        advantages, returns, _ = gae_on_cp_shards(
            self.algo, micro_batches, values, ids, self.rewards, self.offsets, cp_group,
            traces=self.traces, logprobs=logprobs,
        )  # fmt: skip
        out = {"returns": returns, "advantages": advantages}
        return {name: out[name] for name in self.names}


def advantages_and_metrics(
    algo: AlgoConfig,
    scored: Scored,
    inputs: StepInputs,
    *,
    monte_carlo: bool,
    whiten_advantages: bool,
) -> tuple[TokenFields, dict[str, float]]:
    """Advantages and returns of the tokens ``scored`` holds, and the step's statistics.

    With the critic: on its side, GAE (``monte_carlo``: critic pretraining's Monte-Carlo
    returns, no advantages) where the held values are whole sequences (else ``CriticShardGae``
    ran it on the CP shards during the scoring pass), whitening (``whiten_advantages``: zero mean, unit std over the step),
    then the advantages handed to the policy's side (``scored.to_policy``); without it: the
    group estimator on the policy's side. Returns the per-token fields the updates read and
    the metrics (global: the same on every rank). Collective over the sums' group."""
    policy, critic = scored.policy, scored.critic
    metrics: dict[str, float] = {}
    if critic is not None:
        arrays = critic.arrays
        if critic.whole_sequences:  # one packed scan over the held samples
            held = critic.held
            rewards = inputs.rewards[held.ids]
            offsets = held.offsets(inputs.responses.offsets.diff())
            if monte_carlo:
                arrays["returns"] = monte_carlo_returns(rewards, arrays["old_values"], offsets)
            else:
                ratios = None
                if inputs.traces is not None:  # the policy's log-probs: here, or gathered
                    ratios = inputs.traces.held_ratios(
                        held, inputs.responses.offsets, arrays.get("old_logprobs")
                    )
                arrays["advantages"], arrays["returns"], _ = gae_advantages(
                    algo, rewards, arrays["old_values"], offsets, ratios=ratios
                )
        _whiten_and_measure(algo, critic, inputs, metrics, whitened=whiten_advantages)
        if policy is not None and "advantages" in arrays:
            policy.arrays["advantages"] = scored.to_policy(arrays["advantages"])
    elif policy is not None:  # the group estimator: a number per sample
        lengths = inputs.responses.offsets.diff()
        held = policy.held
        per_sample = group_sample_advantages(algo, inputs.rewards)
        policy.arrays["advantages"] = torch.repeat_interleave(
            per_sample[held.ids], lengths[held.ids], output_size=held.num_tokens
        )
        _whiten_and_measure(algo, policy, inputs, metrics, whitened=whiten_advantages)
    return _token_fields(critic, policy), metrics


def logprob_gap_metrics(scored: Scored, inputs: StepInputs) -> dict[str, float]:
    """``rollout/logprob_gap``: the mean over the step's response tokens of |exp(engine's
    log-prob - the trainer's old log-prob) - 1|, each token counted once over the ranks
    (float64 sums over the policy side's group); empty without a policy pass or the engine's
    log-probs. Collective over that group."""
    policy = scored.policy
    if policy is None or inputs.rollout_logprobs is None:
        return {}
    total = int(inputs.responses.offsets[-1])
    counting = policy.sums.counting
    gap = torch.zeros((), dtype=torch.float64, device=HOST)
    if counting is None or any_true(counting):  # a rank that counts none adds 0
        gap = logprob_gap_sum(
            inputs.rollout_logprobs, policy.arrays["old_logprobs"], policy.held,
            inputs.responses.offsets, policy.sums,
        )  # fmt: skip
    (gap_sum,) = policy.sums.total([gap])
    return {"rollout/logprob_gap": gap_sum.item() / total}


def _whiten_and_measure(
    algo: AlgoConfig, side: Side, inputs: StepInputs, metrics: dict[str, float], *, whitened: bool
) -> None:
    """Whitens ``side``'s advantages (``whitened``), and adds the critic's statistics (where it
    holds values) and the advantages' mean and std to ``metrics``."""
    arrays, sums = side.arrays, side.sums
    offsets = inputs.responses.offsets
    lengths = offsets.diff()
    if "advantages" in arrays:  # before whitening moves their zero
        metrics.update(
            failing_advantage_metrics(
                sums, side.held, lengths, arrays["advantages"], inputs.rewards
            )
        )
    if "advantages" in arrays and whitened:
        whiten_(arrays["advantages"], sums)
    if "old_values" in arrays:
        if "advantages" in arrays:  # not critic pretraining
            lam_policy, _ = gae_lambdas(algo, offsets.diff())
            metrics.update(lambda_metrics(lam_policy))
        metrics.update(
            critic_metrics(sums, arrays["returns"], arrays["old_values"], int(offsets[-1]))
        )
        metrics.update(
            first_token_metrics(sums, side.held, arrays["returns"], arrays["old_values"])
        )
        metrics.update(
            profile_metrics(sums, side.held, lengths, arrays["returns"], arrays["old_values"])
        )
    if "advantages" in arrays:
        mean, std = sums.mean_std(arrays["advantages"])
        metrics["advantages/mean"] = mean
        metrics["advantages/std"] = std


def _token_fields(critic: Side | None, policy: Side | None) -> TokenFields:
    """The fields the updates read: each side's arrays at its own starts (the policy's
    advantages, not the critic's, where both exist)."""
    arrays: dict[str, torch.Tensor] = {}
    starts: dict[str, list[int]] = {}
    for side in (critic, policy):
        if side is not None:
            arrays.update(side.arrays)
            starts.update(dict.fromkeys(side.arrays, side.held.start))
    lead = policy if policy is not None else critic
    return TokenFields(lead.held.start, arrays, starts)
