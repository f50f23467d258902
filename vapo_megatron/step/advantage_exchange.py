"""The step's one data path, for any pair of layouts: each model scores and trains on its own
samples, GAE runs where the values are, and only the advantages travel, each token to the
ranks that train the policy on it.

Data flow of one VAPO step (``step/run.py`` calls these in order):

1. Owners, once per step (``scoring_pass.step_share``): for each model, the first epoch's
   mini-batches, each split over *that model's* DP ranks by token counts
   (``batching.dp_owners``). Policy DP rank p(i) and critic DP rank c(i) own sample i for the
   whole step; every rank computes both maps (they depend only on the step's token counts).
   Two models of one DP size get the same map.
2. Scoring (``scoring_pass.score_share``): the policy's DP rank p(i) scores i's old log-probs,
   the critic's DP rank c(i) its values, each into local buffers of its own samples (under
   CP: this CP rank's chunks; under CP with PP reassembled to whole sequences). On one layout
   both passes share one packing.
3. GAE on the critic's owners (``step/advantages.py``): on c(i)'s ranks, whole sequences
   (one packed scan) or under CP without PP on the CP shards as the values come out
   (``gae_on_cp_shards``: one carry per sequence crosses CP ranks). The returns, the critic's
   targets, stay where the critic trains; the statistics and the whitening are float64 sums
   over the host group, each token counted once.
4. Advantages to the policy's owners (``AdvantageExchange``, where p and c differ): one
   all-to-all over the host group. Each token's advantage is sent once per receiving rank by
   one critic rank: the last pipeline stage's first TP rank of c(i), each CP rank its own
   chunks (under CP with PP, CP rank 0 of the reassembled sequences); it goes to every rank
   of p(i)'s last pipeline stage (each TP rank computes the loss; each CP rank gets the whole
   sequence, as an update's packing picks its chunks), and to no other rank. From whole
   sequences a message is just the values of whole samples in ascending order (every rank
   knows both owner maps, so the receiver knows which samples each piece holds); from CP
   chunks it carries their int32 positions in the receiver's buffer too (every rank knows
   where each sample sits in its owner's buffer: ``StepShare.owner_start``), sent once per
   step. The receiver checks that each of its tokens arrives exactly once.
5. Updates (``step/updates.py``): each model's DP rank trains on its own samples of each
   mini-batch (``mine``); the critic reads old values and returns from its side, the policy
   old log-probs and advantages from its own (``TokenFields.starts``).

Host group rather than device: the advantages are host bookkeeping before and after (GAE,
whitening and packing run on the host), so a device all-to-all would add a host-to-device and
a device-to-host copy of every token on both ends; the host all-to-all moves each byte once.
On one layout (``choose_path`` says "shards") every map coincides and ``to_policy`` is the
identity: nothing per token crosses ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.masks import all_true, count_true
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.advantages import CriticShardGae
from vapo_megatron.step.batching import gather_index
from vapo_megatron.step.importance import gather_policy_logprobs
from vapo_megatron.step.outputs import (
    PathChoice,
    Scored,
    Side,
    StepInputs,
    StepModels,
)
from vapo_megatron.step.scoring_pass import ScoringPass, StepShare, score_share


class OwnerPath:
    """Each model's DP rank scores, holds and trains on its ``shares`` entry ("policy",
    "critic"); the critic's advantages go to the policy's owners where the shares differ."""

    def __init__(
        self,
        models: StepModels,
        shares: dict[str, StepShare],
        host_group: dist.ProcessGroup | None,
        *,
        path: PathChoice,
    ) -> None:
        self.models, self.shares, self.host_group = models, shares, host_group
        self.name = path.name
        self.packs_once = path.name == "shards"

    def mine(self, engine: ModelEngine, chosen: Sequence[int]) -> list[int]:
        role = "policy" if engine is self.models.policy else "critic"
        return self.shares[role].mine(chosen, engine.dp_rank)

    def score(
        self,
        models: StepModels,
        inputs: StepInputs,
        *,
        algo: AlgoConfig,
        monte_carlo: bool,
        token_budget: int,
    ) -> Scored:
        """Both passes on their owners' samples (under CP without PP, GAE with ``algo``, or
        critic pretraining's Monte-Carlo targets with ``monte_carlo``, on the critic's
        shards). Collective over the models' groups and the host group."""
        passes = {}
        if models.policy is not None:
            passes["policy"] = ScoringPass(
                "old_logprobs", models.policy, models.logprob_fn, "logprobs"
            )
        if models.critic is not None:
            # Temperature is the policy's; the critic's values are never divided by it.
            passes["critic"] = ScoringPass("old_values", models.critic, models.value_fn, "values")
        kwargs = dict(
            token_budget=token_budget, host_group=self.host_group,
            shard_gae=CriticShardGae(algo, inputs, monte_carlo=monte_carlo),
        )  # fmt: skip
        if self.name == "shards" or len(passes) == 1:  # one share: one packing for both
            role = "critic" if "critic" in passes else "policy"
            side = score_share(list(passes.values()), self.shares[role], inputs, **kwargs)
            return Scored(
                side if "policy" in passes else None, side if "critic" in passes else None
            )
        policy = score_share([passes["policy"]], self.shares["policy"], inputs, **kwargs)
        if inputs.traces is not None:  # the critic's owners need pi_old of their tokens
            gather_policy_logprobs(
                inputs.traces, policy.held, policy.arrays["old_logprobs"], policy.sums,
                inputs.responses.offsets, self.host_group,
            )  # fmt: skip
        critic = score_share([passes["critic"]], self.shares["critic"], inputs, **kwargs)
        exchange = AdvantageExchange(
            self.shares["policy"], self.shares["critic"], critic, models,
            inputs.responses.offsets.diff(), self.host_group,
        )  # fmt: skip
        return Scored(policy, critic, to_policy=exchange.send)


class AdvantageExchange:
    """Moves a per-token array from the critic's owners to the policy's (step 4 of the module
    docstring). Collective over ``host_group`` (its ranks are the world's).

    Where the senders hold whole sequences (the critic without CP, or reassembled under CP
    with PP) every rank knows what each sender sends (its critic DP rank's samples that a
    policy DP rank owns, in ascending order), so only the values travel, as spans of whole
    samples. Where they hold CP chunks, the receiver's positions travel once, when the
    exchange is made (int32), and ``send`` moves the values."""

    def __init__(
        self,
        policy_share: StepShare,
        critic_share: StepShare,
        critic_side: Side,
        models: StepModels,
        response_lengths: torch.Tensor,
        host_group: dist.ProcessGroup | None,
    ) -> None:
        policy, critic = models.policy, models.critic
        layout = critic.layout
        self.host_group, self.num_tokens = host_group, policy_share.num_tokens
        self.whole = layout.cp == 1 or layout.pp > 1
        sends = (
            critic.is_last_stage
            and critic.tp_rank == 0
            and (layout.pp == 1 or critic.cp_rank == 0)  # CP with PP: reassembled on each
        )
        # Who receives: every rank of each policy DP rank's last pipeline stage.
        mine = [policy.dp_rank, int(policy.is_last_stage), critic.dp_rank, int(sends)]
        coords = collectives.all_gather(
            torch.tensor(mine, dtype=torch.long, device=HOST), host_group
        )
        ranks = torch.stack(coords).tolist()
        me = dist.get_rank(host_group)
        if self.whole:
            lengths = response_lengths.tolist()
            self.send_spans = _send_spans(policy_share, critic_share, lengths, ranks, sends)
            self.recv_spans = _recv_spans(
                policy_share, critic_share, lengths, ranks, policy, critic.dp_size
            )
            self.sent_elsewhere = sum(
                b - a for r, spans in enumerate(self.send_spans) if r != me for a, b in spans
            )
            return
        per_dp = self._positions(
            policy_share, critic_share, critic_side, response_lengths, policy.dp_size, sends
        )
        empty = (torch.zeros(0, dtype=torch.long, device=HOST),) * 2
        pieces = [per_dp[d] if last else empty for d, last, _, _ in ranks]
        self.src = [src for src, _ in pieces]
        self.sent_elsewhere = sum(s.numel() for r, s in enumerate(self.src) if r != me)
        index_dtype = torch.int32 if self.num_tokens < 2**31 else torch.long
        received = collectives.all_to_all_varlen(
            [dst.to(index_dtype) for _, dst in pieces], host_group
        )
        self.dst = torch.cat(received).long()
        self.dst_sizes = [piece.numel() for piece in received]  # per sender, in rank order
        if policy.is_last_stage:
            self._check_coverage(policy)

    @staticmethod
    def _positions(
        policy_share: StepShare,
        critic_share: StepShare,
        critic_side: Side,
        response_lengths: torch.Tensor,
        policy_dp: int,
        sends: bool,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per policy DP rank d: (positions in this rank's critic buffers, positions in d's
        policy buffers) of the tokens this rank sends it."""
        empty = torch.zeros(0, dtype=torch.long, device=HOST)
        if not sends:
            return [(empty, empty)] * policy_dp
        ids = critic_share.ids
        lengths = response_lengths[ids]
        local = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        owners = torch.tensor(policy_share.owners, dtype=torch.long, device=HOST)[ids]
        shift = policy_share.owner_start[ids] - local[:-1]
        held = critic_side.held_mask
        out = []
        for d in range(policy_dp):
            rows = (owners == d).nonzero().squeeze(1)
            src = gather_index(local, rows)
            dst = src + torch.repeat_interleave(shift[rows], lengths[rows], output_size=src.numel())
            if held is not None and not all_true(held):  # CP chunks: only the held ones
                keep = held[src]
                src, dst = src[keep], dst[keep]
            out.append((src, dst))
        return out

    def _check_coverage(self, policy: ModelEngine) -> None:
        seen = torch.zeros(self.num_tokens, dtype=torch.bool, device=HOST)
        seen[self.dst] = True
        if self.dst.numel() != self.num_tokens or not all_true(seen):
            raise RuntimeError(
                f"the policy's rank {dist.get_rank()} (dp_rank {policy.dp_rank}) was sent "
                f"{self.dst.numel()} advantages for its {self.num_tokens} response tokens "
                f"({count_true(seen)} distinct): each must come exactly once"
            )

    def send(self, critic_array: torch.Tensor) -> torch.Tensor:
        """``critic_array`` ([critic buffer], this rank's critic side) -> [policy buffer] of
        this rank's policy side (zeros off the last pipeline stage).

        Memory: the pieces for other ranks are written straight into one send buffer, which is
        freed before the [policy buffer] is made; this rank's own piece never leaves
        ``critic_array``. At the 32B step's shape the exchange then holds at most the receive
        buffer and the result beside its input (docs/benchmarks.md)."""
        critic_array = critic_array.to(torch.float32)
        me = dist.get_rank(self.host_group)
        if not self.whole:
            return self._send_positions(critic_array, me)
        sizes = [sum(b - a for a, b in spans) for spans in self.send_spans]
        sizes[me] = 0  # kept here: no copy into the send buffer and back out of gloo

        def write(rank: int, buffer: torch.Tensor) -> None:
            torch.cat([critic_array[a:b] for a, b in self.send_spans[rank]], out=buffer)

        received = self._exchange(sizes, write)
        out = torch.zeros(self.num_tokens, dtype=torch.float32, device=HOST)
        for rank, (piece, spans) in enumerate(zip(received, self.recv_spans, strict=True)):
            chunks = [critic_array[a:b] for a, b in self.send_spans[me]] if rank == me else [piece]
            _fill_spans(out, spans, chunks, me)
        return out

    def _send_positions(self, critic_array: torch.Tensor, me: int) -> torch.Tensor:
        """``send`` from CP chunks: the values at ``src`` of each receiver, to its ``dst``."""
        sizes = [src.numel() if rank != me else 0 for rank, src in enumerate(self.src)]

        def write(rank: int, buffer: torch.Tensor) -> None:
            torch.index_select(critic_array, 0, self.src[rank], out=buffer)

        received = self._exchange(sizes, write)
        out = torch.zeros(self.num_tokens, dtype=torch.float32, device=HOST)
        for rank, (piece, dst) in enumerate(
            zip(received, self.dst.split(self.dst_sizes), strict=True)
        ):
            piece = critic_array[self.src[me]] if rank == me else piece
            if piece.numel() != dst.numel():  # never broadcast one value over many positions
                raise RuntimeError(
                    f"rank {me} was sent {piece.numel()} advantages by host rank {rank}, which "
                    f"owes it {dst.numel()}: the ranks disagree on the step's owners"
                )
            out[dst] = piece
        return out

    def _exchange(self, sizes: list[int], write) -> list[torch.Tensor]:
        """``collectives.all_to_all_flat`` of one float32 send buffer whose piece for rank r
        (``sizes[r]`` values) ``write(r, piece)`` fills in place; the buffer is freed on
        return, before the caller makes its [policy buffer]."""
        x = torch.empty(sum(sizes), dtype=torch.float32, device=HOST)
        for rank, piece in enumerate(x.split(sizes)):
            if piece.numel():
                write(rank, piece)
        return collectives.all_to_all_flat(x, sizes, self.host_group)


def _fill_spans(
    out: torch.Tensor, spans: list[tuple[int, int]], chunks: list[torch.Tensor], rank: int
) -> None:
    """Copies ``chunks`` (laid end to end) into ``out``'s ``spans``, in order; raises where
    their lengths differ (the sender and this rank, ``rank`` of the host group, disagree on
    the step's owners)."""
    total = sum(c.numel() for c in chunks)
    owed = sum(b - a for a, b in spans)
    if total != owed:
        raise RuntimeError(
            f"rank {rank} was sent {total} advantages by a critic rank that owes it "
            f"{owed}: the ranks disagree on the step's owners"
        )
    source = iter(chunks)
    chunk, used = None, 0
    for a, b in spans:
        while a < b:
            if chunk is None or used == chunk.numel():
                chunk, used = next(source), 0
                continue
            n = min(b - a, chunk.numel() - used)
            out[a : a + n] = chunk[used : used + n]
            a, used = a + n, used + n


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [a, b) spans merged (one copy per run, not per sample)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _send_spans(
    policy_share: StepShare,
    critic_share: StepShare,
    lengths: list[int],
    ranks: list[list[int]],
    sends: bool,
) -> list[list[tuple[int, int]]]:
    """Per world rank: the spans of this rank's critic buffers it is sent (its critic
    samples that the rank's policy DP rank owns, ascending), if it receives at all."""
    by_dp: dict[int, list[tuple[int, int]]] = {}
    if sends:
        owners, start = policy_share.owners, critic_share.start
        for i in critic_share.ids.tolist():
            by_dp.setdefault(owners[i], []).append((start[i], start[i] + lengths[i]))
    return [_runs(by_dp.get(dp, [])) if last else [] for dp, last, _, _ in ranks]


def _recv_spans(
    policy_share: StepShare,
    critic_share: StepShare,
    lengths: list[int],
    ranks: list[list[int]],
    policy: ModelEngine,
    critic_dp: int,
) -> list[list[tuple[int, int]]]:
    """Per world rank: the spans of this rank's policy buffers its piece fills (its policy
    samples that the sender's critic DP rank owns, ascending). Checks that each critic DP
    rank has exactly one sender, so every sample arrives once."""
    senders = sorted(c_dp for _, _, c_dp, sends in ranks if sends)
    if senders != list(range(critic_dp)):
        raise RuntimeError(
            f"advantage senders by critic DP rank {senders}: each of the critic's {critic_dp} "
            "DP ranks must send once"
        )
    by_dp: dict[int, list[tuple[int, int]]] = {}
    if policy.is_last_stage:
        owners, start = critic_share.owners, policy_share.start
        for i in policy_share.ids.tolist():
            by_dp.setdefault(owners[i], []).append((start[i], start[i] + lengths[i]))
    return [_runs(by_dp.get(c_dp, [])) if sends else [] for _, _, c_dp, sends in ranks]
