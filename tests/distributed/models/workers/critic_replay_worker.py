"""Worker: routing replay of an MoE critic (``step/critic_routes.py``) at one layout.

A tiny random Qwen3-MoE critic (transformers' trunk + a score row, loaded through the record)
on the model's own groups, with ``track_routes(replay=True)``:

1. the scoring pass (``scoring_pass.score_share``, the trainer's own) keeps each of this DP
   rank's samples' routes: they must be transformers' router top-k of every token (prompt and
   response), over this rank's layers only (``router_replay.layers``: its stage's);
2. the update's micro-batches (other samples together, another token budget: each sample at
   another place of the row, under SP in another TP slice) carry those routes
   (``critic_routes.step_routes`` -> ``build_samples(routes=)``) and their forward, weights
   unchanged, gives transformers' values: the update's forward equals the scoring forward;
3. with the routers moved (as earlier mini-batches move them), every router call of the
   update's forward and of its recompute in the backward pass (full recompute) uses exactly
   the recorded experts; with replay off the agreement is below 1 and the calls differ.

Usage: python critic_replay_worker.py TPxPPxCPxEP[,...] OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from qwen3_parity_worker import checkpoint_tensors, gather_full, rows_of
from transformers import AutoModel

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.step.advantages import CriticShardGae
from vapo_megatron.step.batching import ROUTES, Ragged, build_samples, micro_batches
from vapo_megatron.step.critic_routes import step_routes
from vapo_megatron.step.losses import value_scoring_fn
from vapo_megatron.step.outputs import StepInputs
from vapo_megatron.step.scoring_pass import ScoringPass, score_share, step_share
from vapo_megatron.step.updates import route_agreement
from vapo_megatron.tiny.model import tiny_qwen3_config, train_tokenizer

LENGTHS = [(3, 9), (6, 2), (2, 5), (5, 7), (4, 11), (7, 3)]  # (prompt, response) per sample
LAYERS = 4


def reference():
    """The critic's HF config, its samples, their values [n] and routes [n, layers, top_k]."""
    tokenizer = train_tokenizer(["12+34=46", "Answer: 46", "7*8=56 and 9-3=6"], vocab_size=300)
    config = tiny_qwen3_config(tokenizer, moe=True, num_layers=LAYERS)
    config.initializer_range = 0.1  # router logits far apart: no near-ties in the top-k
    torch.manual_seed(0)
    trunk = AutoModel.from_config(config).float().eval()
    score = torch.randn(1, config.hidden_size) * 0.1
    gen = torch.Generator().manual_seed(1)
    tokens, values, routes = [], [], []
    for n_prompt, n_resp in LENGTHS:
        ids = torch.randint(0, config.vocab_size, (n_prompt + n_resp,), generator=gen)
        with torch.no_grad():
            out = trunk(ids[None], output_router_logits=True)
        tokens.append(ids)
        values.append((out.last_hidden_state[0] @ score.T)[:, 0])
        logits = torch.stack([r.reshape(len(ids), -1) for r in out.router_logits], 1)
        routes.append(logits.topk(config.num_experts_per_tok, dim=-1).indices)
    sd = {f"model.{k}": v for k, v in checkpoint_tensors(trunk).items()}
    sd["score.weight"] = score
    return HFModelConfig.from_hf(config.to_dict()), tokens, values, routes, sd


def ragged(rows: list[torch.Tensor]) -> Ragged:
    lengths = torch.tensor([len(r) for r in rows])
    return Ragged(torch.cat(rows), torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))


def router_calls(engine, run):
    """Run ``run()``; each router call's experts per router: {j: [[t, top_k] sorted]}, j the
    router's column in the routes this rank carries (``router_replay.layers`` order)."""
    calls: dict[int, list[torch.Tensor]] = {}
    hooks = []
    column = {layer: j for j, layer in enumerate(engine.router_replay.layers)}
    for router in engine.router_replay.routers:

        def hook(mod, args, out):
            picked = out[1].nonzero()[:, 1].view(out[1].shape[0], -1)
            calls.setdefault(column[mod.layer_number - 1], []).append(picked)

        hooks.append(router.register_forward_hook(hook))
    result = run()
    for h in hooks:
        h.remove()
    return calls, result


def given_routes(engine, mbs) -> list[torch.Tensor]:
    """Each micro-batch's routes as this rank's routers see them (CP row, TP slice under SP)."""
    out = []
    for mb in mbs:
        row = mb.fields[ROUTES][0].long()
        if engine.layout.sequence_parallel:
            row = row.chunk(engine.layout.tp)[engine.tp_rank]
        out.append(row)
    return out


def check_calls(calls, given, *, equal: bool, forwards: int, ordered: bool) -> None:
    """Every call used (``equal``) or did not all use the routes of the micro-batch it ran.
    ``ordered`` (no pipeline): call k of a layer ran micro-batch k // forwards (each one's
    forward, then its recompute); under a pipeline's schedule a call is matched against the
    micro-batches of its size that give routes. A slice with no given route (all padding, as
    a TP slice of a short CP row can be) has nothing to check."""
    differs = False
    checked = 0
    for layer, picks in calls.items():
        assert len(picks) == len(given) * forwards, (layer, len(picks), len(given))
        for k, picked in enumerate(picks):
            candidates = [given[k // forwards]] if ordered else given
            matches = []
            for routes in candidates:
                if routes.shape[0] != picked.shape[0]:
                    continue
                want = routes[:, layer]
                has = (want >= 0).all(-1)
                if bool(has.any()):
                    matches.append(torch.equal(picked[has], want[has].sort(-1).values))
            if not matches:
                assert not ordered or candidates[0].shape[0] == picked.shape[0], (layer, k)
                continue
            checked += 1
            if equal:
                assert any(matches), f"layer {layer}: a call used other experts than recorded"
            differs |= not any(matches)
    assert checked, "no router call had routes to compare"
    if not equal:
        assert differs, "with replay off every call still used the recorded experts"


def main(names: str, out_dir: str) -> None:
    initialize_cpu_process_group()
    host = make_host_group()
    reference_data = reference()
    for name in names.split(","):
        check(name, reference_data, host, out_dir)


def check(name: str, reference_data, host, out_dir: str) -> None:
    tp, pp, cp, ep = (int(v) for v in name.split("x"))
    hf, tokens, values, routes, sd = reference_data
    layout = ModelLayout(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=tp > 1)
    groups = build_model_groups(tp=tp, pp=pp, cp=cp, ep=ep, host=host)
    critic = ModelEngine(
        hf, layout, head="value", optim=OptimSettings(lr=1e-3), groups=groups,
        recompute=RecomputeSettings(granularity="full", method="uniform", num_layers=1),
    )  # fmt: skip
    critic.load_hf(sd)
    critic.track_routes(replay=True)
    prompts = ragged([t[:p] for t, (p, _) in zip(tokens, LENGTHS, strict=True)])
    responses = ragged([t[p:] for t, (p, _) in zip(tokens, LENGTHS, strict=True)])
    count = len(LENGTHS)
    share = step_share(
        [torch.arange(count)], [p + r for p, r in LENGTHS], responses.lengths(),
        dp_size=critic.dp_size, dp_rank=critic.dp_rank,
    )  # fmt: skip
    inputs = StepInputs(prompts, responses, torch.ones(count), None)
    side = score_share(
        [ScoringPass("old_values", critic, value_scoring_fn(), "values")], share, inputs,
        token_budget=40, host_group=host,
        shard_gae=CriticShardGae(AlgoConfig(), inputs, monte_carlo=False),
    )  # fmt: skip
    mine = share.ids.tolist()
    assert sorted(side.routes) == mine, (sorted(side.routes), mine)
    stage_layers = critic.router_replay.layers
    assert len(stage_layers) == LAYERS // layout.pp
    for i in mine:  # 1. the scoring pass kept transformers' routes, this stage's layers
        kept = side.routes[i]
        assert kept.dtype == torch.int16 and kept.shape == (len(tokens[i]), len(stage_layers), 2)
        got = kept.long().sort(-1).values
        assert torch.equal(got, routes[i][:, stage_layers].sort(-1).values), f"sample {i}"

    # 2. The update's micro-batches: other groupings, the recorded routes replayed.
    kept = step_routes(side.routes, count, (len(stage_layers), 2))
    order = mine[::-1]
    samples = build_samples(prompts, responses, order, responses.offsets, routes=kept)
    mbs = micro_batches(samples, layout, cp_rank=critic.cp_rank, token_budget=24, field_names=[])
    outs = critic.run(mbs, value_scoring_fn(), forward_only=True)
    worst = 0.0
    if critic.is_last_stage and order:
        first = 0
        for mb, out in zip(mbs, outs, strict=True):
            full = gather_full(out["values"][..., None], mb, groups)
            for j, got in enumerate(rows_of(full, mb, mb.num_seqs)):
                want = values[order[first + j]]
                worst = max(worst, (got[: len(want), 0] - want).abs().max().item())
            first += mb.num_seqs
        assert worst < 2e-5, f"{name}: the update's forward differs from the scoring's: {worst}"

    # 3. Routers moved: replayed in the forward and the backward recompute; off: not.
    with torch.no_grad():
        for chunk in critic.chunks:
            for pname, param in chunk.named_parameters():
                if pname.endswith("router.weight"):
                    param.add_(torch.randn_like(param) * 2.0)
    given = given_routes(critic, mbs) if order else []

    def loss(out, mb):
        return (out[..., 0] * mb.response_mask).sum() / 100.0, {}

    if order:
        calls, _ = router_calls(critic, lambda: critic.run(mbs, loss))
        check_calls(calls, given, equal=True, forwards=2, ordered=pp == 1)
    else:  # a rank without samples still takes part in every collective
        critic.run(mbs, loss)
    replayed_agreement = route_agreement(critic)
    critic.replay_routes = False
    calls, _ = router_calls(critic, lambda: critic.run(mbs, value_scoring_fn(), forward_only=True))
    agreement = route_agreement(critic)
    if order:
        check_calls(calls, given, equal=False, forwards=1, ordered=pp == 1)
    assert 0.0 < agreement < 1.0, agreement
    print(
        f"rank {dist.get_rank()}: {name}: samples {mine} routes = transformers'; update forward "
        f"max diff {worst:.2e}; moved routers: replayed (own top-k agreed "
        f"{replayed_agreement:.3f}), off: agreement {agreement:.3f}"
    )
    Path(out_dir, f"ok-{name}-{dist.get_rank()}").write_text("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
