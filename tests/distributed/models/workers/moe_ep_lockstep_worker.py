"""Worker: an EP2 MoE policy whose two DP ranks pack different numbers of micro-batches.

Usage: python moe_ep_lockstep_worker.py OUT.pt. At EP 2 on 2 ranks (DP 2) both DP ranks form
the expert-parallel group, so megatron's token dispatcher runs a collective over them in every
MoE layer of every micro-batch. The samples make the DP shares equal in tokens but not in
micro-batches: rank 0 owns one long sample (one micro-batch), rank 1 six short ones (three
micro-batches at ``TOKEN_BUDGET``). The scoring pass (``scoring_pass.score_share``, two
micro-batches a chunk here) and an update (``updates.train_on``) run at EP1 (the reference:
experts replicated, no collective across DP in the forward) and at EP2, both with routing
replay of given routes. Without lining the ranks up the EP2 run hangs in the dispatcher's
all-to-all. Rank 0 saves each layout's scored log-probs (every sample, gathered over the host
group), reduced gradients, updated weights, metrics, micro-batch counts and how many MAX
all-reduces over the host group (the counts' agreement) the layout made.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.distributed.models.workers.moe_ep_step_worker import (
    ALGO,
    OPTIM,
    reduced_gradients,
    reference,
)
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.data.packing import Sample
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.router_replay import ROUTES
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.collectives import all_gather_objects, make_host_group
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
from vapo_megatron.step import scoring_pass
from vapo_megatron.step.batching import FLAT_INDEX, Ragged
from vapo_megatron.step.losses import logprob_scoring_fn, policy_loss_fn
from vapo_megatron.step.outputs import StepInputs, score_flat
from vapo_megatron.step.updates import train_on

LENGTHS = [(10, 20)] + [(2, 3)] * 6  # (prompt, response): 30 tokens, then 6 x 5 tokens
TOKEN_BUDGET = 12  # rank 0: 1 micro-batch; rank 1: 3 (two samples each)
FIELDS = [FLAT_INDEX, "old_logprobs", "advantages", "positive", "seq_num_tokens", ROUTES]
LAYOUTS = {"ep1": 1, "ep2": 2}


def step_data(vocab: int, num_layers: int, num_experts: int, top_k: int):
    """Token rows, per-sample routes ([prompt + response - 1, layers, top_k] int16: distinct
    random experts per token and layer) and the update's samples."""
    gen = torch.Generator().manual_seed(5)
    prompts, responses, routes, samples = [], [], [], []
    offset = 0
    for i, (n_prompt, n_resp) in enumerate(LENGTHS):
        ids = torch.randint(2, vocab, (n_prompt + n_resp,), generator=gen, dtype=torch.int32)
        scores = torch.rand(n_prompt + n_resp - 1, num_layers, num_experts, generator=gen)
        route = scores.topk(top_k, dim=-1).indices.to(torch.int16)
        prompts.append(ids[:n_prompt])
        responses.append(ids[n_prompt:])
        routes.append(route)
        fields = {
            FLAT_INDEX: torch.arange(offset, offset + n_resp, device=HOST),
            "old_logprobs": -5.8 + 0.1 * torch.randn(n_resp, generator=gen),
            "advantages": torch.randn(n_resp, generator=gen),
            "positive": torch.full((n_resp,), i % 3 == 0, device=HOST),
            "seq_num_tokens": torch.full((n_resp,), float(n_resp), device=HOST),
            ROUTES: route,
        }
        offset += n_resp
        samples.append(Sample(ids[:n_prompt].tolist(), ids[n_prompt:].tolist(), fields))
    return prompts, responses, routes, samples


def ragged(rows: list[torch.Tensor]) -> Ragged:
    lengths = torch.tensor([len(r) for r in rows], device=HOST)
    return Ragged(torch.cat(rows), torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))


def count_runs(engine: ModelEngine, counts: list[int]) -> None:
    """Record the number of micro-batches of each ``engine.run``."""
    run = engine.run

    def counted(micro_batches, *args, **kwargs):
        counts.append(len(micro_batches))
        return run(micro_batches, *args, **kwargs)

    engine.run = counted


def score(engine: ModelEngine, data, host) -> torch.Tensor:
    """The scoring pass's old log-probs of every response token, flat (host group gather)."""
    prompts, responses, routes, _ = data
    responses_flat = ragged(responses)
    route_lengths = torch.tensor([len(r) for r in routes], device=HOST)
    step_routes = (torch.cat(routes), torch.nn.functional.pad(route_lengths.cumsum(0), (1, 0)))
    counts = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    share = scoring_pass.step_share(
        [torch.arange(len(counts), device=HOST)], counts, responses_flat.lengths(),
        dp_size=engine.dp_size, dp_rank=engine.dp_rank,
    )  # fmt: skip
    inputs = StepInputs(
        ragged(prompts), responses_flat, torch.ones(len(counts), device=HOST), None,
        routes=step_routes,
    )  # fmt: skip
    scoring = scoring_pass.ScoringPass(
        "old_logprobs", engine, logprob_scoring_fn(engine.vocab_slice), "logprobs"
    )
    side = scoring_pass.score_share(
        [scoring], share, inputs, token_budget=TOKEN_BUDGET, host_group=host,
    )  # fmt: skip
    flat = torch.zeros(int(responses_flat.offsets[-1]), device=HOST)
    for part in all_gather_objects((share.ids.tolist(), side.arrays["old_logprobs"]), host):
        ids, values = part
        pieces = [
            slice(int(responses_flat.offsets[i]), int(responses_flat.offsets[i + 1])) for i in ids
        ]
        flat[torch.cat([torch.arange(s.start, s.stop) for s in pieces])] = values
    return flat


def count_max_reductions(counts: list[int], host) -> None:
    """Record each MAX all-reduce over the host group (the micro-batch counts' agreement)."""
    all_reduce = collectives.all_reduce

    def counted(tensor, group, op=dist.ReduceOp.SUM):
        if op == dist.ReduceOp.MAX and group is host:
            counts.append(1)
        return all_reduce(tensor, group, op)

    collectives.all_reduce = counted


def one_layout(name: str, hf, sd, data, host, max_reductions: list[int]) -> dict:
    ep = LAYOUTS[name]
    groups = build_model_groups(tp=1, pp=1, cp=1, ep=ep, host=host)
    engine = ModelEngine(hf, ModelLayout(ep=ep), head="lm", optim=OPTIM, groups=groups)
    engine.load_hf(sd)
    # The reference scorer (checks and tests) lines up too: its token-balanced shares give
    # rank 0 one micro-batch and rank 1 three. Its own routes: no replay yet.
    flat = score_flat(
        engine, [p.tolist() for p in data[0]], [r.tolist() for r in data[1]],
        scoring_fn=logprob_scoring_fn(engine.vocab_slice), output_key="logprobs",
        token_budget=TOKEN_BUDGET,
    )  # fmt: skip
    max_reductions.clear()
    engine.track_routes(replay=True)
    counts: list[int] = []
    count_runs(engine, counts)
    found: dict = {"logprobs": score(engine, data, host), "flat": flat}
    step = engine.step

    def step_after_reading_gradients():
        found["grads"] = reduced_gradients(engine)
        return step()

    engine.step = step_after_reading_gradients
    vocab = engine.vocab_slice
    metrics = train_on(
        engine, data[3], lambda norm: policy_loss_fn(ALGO, norm, vocab), field_names=FIELDS,
        token_budget=TOKEN_BUDGET,
    )  # fmt: skip
    found["weights"] = dict(engine.hf_weights())
    found["metrics"] = {k: float(v) for k, v in metrics.items()}
    found["counts"] = all_gather_objects(counts, host)
    found["max_reductions"] = len(max_reductions)
    max_reductions.clear()
    return found


def main(out: str) -> None:
    initialize_cpu_process_group()
    ensure_global_memory_buffer()
    host = make_host_group()
    scoring_pass.SCORING_CHUNK = 2  # chunks must line up across the DP ranks too
    hf, sd, vocab = reference()
    data = step_data(vocab, hf.num_layers, hf.num_experts, hf.moe_top_k)
    results = {}
    max_reductions: list[int] = []
    count_max_reductions(max_reductions, host)
    for name in LAYOUTS:
        results[name] = one_layout(name, hf, sd, data, host, max_reductions)
        print(f"rank {dist.get_rank()}: {name}: {results[name]['counts']}", flush=True)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
